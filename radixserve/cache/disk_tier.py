"""The disk tier: KV pages that left the pool, one file per page under DIR/<kv digest>/, with a size limit and LRU.

Only one process uses a directory at a time (an fcntl lock on DIR/lock; a second server gets TierLockedError naming
the holder). The index (key -> prefix digest, file size, in LRU order) lives in memory and is written to
index.json beside the pages on checkpoints and at shutdown; on start it is read back and reconciled with the files
there (a file the index lacks is admitted if its header checks out, anything else is deleted). A write that fails
(disk full, read-only) turns spilling off with one warning; reads go on. A file that fails any check on read is a
miss and is deleted. Pins (/cache/pin) are saved beside the index in pins.json, so a restart restores them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from radixserve.cache import page_file
from radixserve.cache.page_file import PageFileError

log = logging.getLogger(__name__)

INDEX = "index.json"
PINS = "pins.json"
SUFFIX = ".kv"


class TierLockedError(RuntimeError):
    """Another process holds the cache directory."""


@dataclass
class DiskEntry:
    prefix: int  # xxh3_128 of the page's namespace and full prefix: confirms a key hit without opening the file
    nbytes: int  # file size
    namespace: str  # for per-namespace flush


@dataclass
class DiskStats:
    written_pages: int = 0
    read_pages: int = 0
    bad_files: int = 0  # torn, truncated, corrupted or foreign files found (each deleted, each a miss)
    lru_evicted_pages: int = 0
    write_errors: int = 0


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierLockedError(
            f"--kv-cache-dir {path.parent} is in use by another radixserve process (pid {holder}); "
            "give each server its own directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class DiskTier:
    def __init__(self, root: str | Path, limit_bytes: int, digest: str, payload_bytes: int) -> None:
        self.root = Path(root)
        self.dir = self.root / digest
        self.dir.mkdir(parents=True, exist_ok=True)  # OSError (read-only, no permission): the caller goes without
        self._lock_fd: int | None = _lock(self.root / "lock")
        self.digest = digest
        self.payload_bytes = payload_bytes
        self.limit_bytes = limit_bytes
        self.index: OrderedDict[int, DiskEntry] = OrderedDict()  # oldest first
        self.bytes = 0
        self.writable = True
        self.dirty = False  # the index changed since it was last saved
        self.stats = DiskStats()
        self._load()

    # ---- start-up --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        saved: list[list] = []
        try:
            doc = json.loads((self.dir / INDEX).read_text())
            if doc.get("digest") == self.digest:
                saved = doc["pages"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no index or a broken one: the files' own headers rebuild it below
        files = {}
        for f in self.dir.iterdir():
            if f.suffix == SUFFIX:
                files[f.name] = f
            elif f.name not in (INDEX, PINS):
                self._unlink(f)  # a write torn by a crash (*.tmp) or a stranger
        for row in saved:
            try:
                key, prefix, nbytes, ns = int(row[0], 16), int(row[1], 16), int(row[2]), str(row[3])
            except (ValueError, TypeError, IndexError):
                continue
            f = files.pop(f"{key:016x}{SUFFIX}", None)
            if f is not None and f.stat().st_size == nbytes:
                self._add(key, DiskEntry(prefix, nbytes, ns))
            elif f is not None:
                self._drop_bad(f, "size differs from the index")
        for f in files.values():  # written after the last saved index
            self._admit_unindexed(f)
        self._make_room(0)

    def _admit_unindexed(self, f: Path) -> None:
        try:
            with f.open("rb") as fh:
                head = fh.read(page_file.MAX_HEADER + 64)
            header, off = page_file.decode_header(head)
            size = f.stat().st_size
            if (
                header.digest != self.digest
                or f.name != f"{header.key:016x}{SUFFIX}"
                or header.payload_bytes != self.payload_bytes
                or size != off + header.payload_bytes
            ):
                raise PageFileError("foreign or truncated file")
        except (OSError, PageFileError) as exc:
            self._drop_bad(f, str(exc))
            return
        self.index[header.key] = DiskEntry(header.prefix, size, header.namespace)
        self.index.move_to_end(header.key, last=False)  # unknown age: evict it first
        self.bytes += size
        self.dirty = True

    # ---- lookups ---------------------------------------------------------------------------------------------
    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    def lookup(self, key: int, prefix: int) -> bool:
        """Whether the tier holds this page (same key and same prefix digest)."""
        e = self.index.get(key)
        return e is not None and e.prefix == prefix

    def touch(self, keys: Iterable[int]) -> None:
        """Mark pages most recently used, in the order given (pass descendants before ancestors: the LRU end then
        drops a prefix's tail first and never leaves a page whose parent is gone)."""
        for k in keys:
            if k in self.index:
                self.index.move_to_end(k)
        self.dirty = True

    def get(self, key: int, prefix: int) -> memoryview | None:
        """The page's payload, or None (a miss) if the file is missing or fails a check (it is then deleted)."""
        if not self.lookup(key, prefix):
            return None
        f = self.path(key)
        try:
            data = f.read_bytes()
            payload = page_file.decode(data, self.digest, key, prefix, self.payload_bytes)
        except (OSError, PageFileError) as exc:
            self._drop_bad(f, str(exc))
            self._remove(key)
            return None
        self.stats.read_pages += 1
        return payload

    # ---- writes ----------------------------------------------------------------------------------------------
    def put(self, key: int, prefix: int, payload: bytes | memoryview, namespace: str) -> bool:
        """Store one page (a no-op if held); False if it cannot be written (then spilling is off from here on)."""
        if self.lookup(key, prefix):
            self.index.move_to_end(key)
            return True
        if not self.writable:
            return False
        data = page_file.encode(self.digest, key, prefix, payload, namespace)
        if len(data) > self.limit_bytes:
            return False
        if key in self.index:  # same key, another prefix (a 64-bit collision): the newer page wins
            self._delete(key)
        self._make_room(len(data))
        f = self.path(key)
        tmp = f.with_suffix(".tmp")
        try:
            with tmp.open("wb") as fh:
                fh.write(data)
            os.replace(tmp, f)  # atomic: a reader sees the whole old file or the whole new one
        except OSError as exc:
            self._unlink(tmp)
            self._write_failed(exc)
            return False
        self._add(key, DiskEntry(prefix, len(data), namespace))
        self.stats.written_pages += 1
        return True

    def _write_failed(self, exc: OSError) -> None:
        self.stats.write_errors += 1
        self.writable = False
        why = (
            "disk full"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else ("read-only" if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "write failed")
        )
        log.warning("kv cache dir %s: %s (%s); pages evicted from now on are dropped, not spilled", self.dir, why, exc)

    def _make_room(self, nbytes: int) -> None:
        while self.index and self.bytes + nbytes > self.limit_bytes:
            key = next(iter(self.index))
            self._delete(key)
            self.stats.lru_evicted_pages += 1

    def _add(self, key: int, entry: DiskEntry) -> None:
        self.index[key] = entry
        self.bytes += entry.nbytes
        self.dirty = True

    def _remove(self, key: int) -> None:
        e = self.index.pop(key, None)
        if e is not None:
            self.bytes -= e.nbytes
            self.dirty = True

    def _delete(self, key: int) -> None:
        self._remove(key)
        self._unlink(self.path(key))

    def _drop_bad(self, f: Path, why: str) -> None:
        self.stats.bad_files += 1
        log.warning("kv cache dir: %s is unusable (%s): deleted, treated as a miss", f.name, why)
        self._unlink(f)

    @staticmethod
    def _unlink(f: Path) -> None:
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("could not delete %s: %s", f, exc)

    # ---- whole-tier operations -------------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every page (flush_cache)."""
        for key in list(self.index):
            self._delete(key)
        self.save_index()

    def drop_namespaces(self, accept: Callable[[str], bool]) -> int:
        """Delete every page of the namespaces `accept` takes (per-namespace flush); returns how many."""
        gone = [k for k, e in self.index.items() if accept(e.namespace)]
        for key in gone:
            self._delete(key)
        if gone:
            self.save_index()
        return len(gone)

    def save_index(self) -> None:
        """Write index.json beside the pages (atomically); a failure is logged, never raised."""
        doc = {
            "digest": self.digest,
            "pages": [[f"{k:016x}", f"{e.prefix:032x}", e.nbytes, e.namespace] for k, e in self.index.items()],
        }
        if self._write_json(INDEX, doc):
            self.dirty = False

    def _write_json(self, name: str, doc: object) -> bool:
        """Replace DIR/<digest>/name atomically; a failure is logged, never raised."""
        tmp = self.dir / (name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.dir / name)
            return True
        except OSError as exc:
            self._unlink(tmp)
            log.warning("kv cache dir %s: cannot save %s (%s)", self.dir, name, exc)
            return False

    def save_pins(self, pins: list[tuple[str, list[int]]]) -> None:
        """Write the pinned prompts (namespace, full-page tokens) for the next start."""
        self._write_json(PINS, {"digest": self.digest, "pins": [[ns, tokens] for ns, tokens in pins]})

    def load_pins(self) -> list[tuple[str, list[int]]]:
        """The pins saved by the last run on this directory; a missing or broken file is no pins."""
        try:
            doc = json.loads((self.dir / PINS).read_text())
            if doc.get("digest") != self.digest:
                return []
            return [(str(ns), [int(t) for t in tokens]) for ns, tokens in doc["pins"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def close(self) -> None:
        """Save the index and release the directory lock."""
        if self._lock_fd is None:
            return
        self.save_index()
        os.close(self._lock_fd)
        self._lock_fd = None

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    @property
    def num_pages(self) -> int:
        return len(self.index)
