"""The tiers under the radix tree: pages evicted from the pool go to a HostTier (pinned host RAM, when the pool is on
a GPU) and on from its LRU end to a DiskTier (--kv-cache-dir), or straight to the DiskTier when there is no host
tier; a later match continues into them, loading the pages back into the pool (one batched copy per layer) before the
request's prefill.

A page in the tier is named by its chained tree key and confirmed by the 128-bit digest of its namespace and whole
prefix, so a hit is exact (a 64-bit key collision is a miss) and namespaces never meet. The tiers are inclusive: a page
loaded back keeps its slot or file, so evicting it again copies nothing. RadixCache calls `spill` from evict(); the
scheduler calls `load_prefix` before it matches a request it is about to admit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from radixserve.cache.disk_tier import DiskTier, TierLockedError
from radixserve.cache.host_tier import HostTier, host_tier_bytes
from radixserve.cache.kv_digest import KVLayout, kv_digest
from radixserve.cache.kv_format import dtype_name
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.tree_node import as_bytes

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache, TreeNode

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    """One tier's traffic with the pool (the disk's spills also count pages cascading from the host tier)."""

    spilled_pages: int = 0  # pages written to the tier (evictions, the host tier's LRU, checkpoints)
    loaded_pages: int = 0  # pages loaded back into the pool
    load_seconds: float = 0.0  # on CUDA, host loads count the time to enqueue their copies
    hit_tokens: int = 0  # prompt tokens served by pages loaded from the tier

    def snapshot(self, tier: str) -> dict[str, float | int]:
        return {
            f"{tier}_hit_tokens": self.hit_tokens,
            f"{tier}_spilled_pages": self.spilled_pages,
            f"{tier}_loaded_pages": self.loaded_pages,
            f"{tier}_load_seconds": self.load_seconds,
            f"{tier}_load_seconds_per_page": self.load_seconds / self.loaded_pages if self.loaded_pages else 0.0,
        }


def prefix_hasher(namespace: str) -> xxhash.xxh3_128:
    h = xxhash.xxh3_128()
    h.update(namespace.encode("utf-8") + b"\0")
    return h


class KVTier:
    """At least one of `host` and `store` (the disk tier) is set."""

    def __init__(self, store: DiskTier | None, pool: KVPool, layout: KVLayout, host: HostTier | None = None) -> None:
        self.store = store
        self.host = host
        self.pool = pool
        self.layout = layout
        self.stats = TierStats()  # the disk tier's
        self.host_stats = TierStats()

    # ---- spill -----------------------------------------------------------------------------------------------
    def spill(self, cache: RadixCache, node: TreeNode, first: int) -> None:
        """Copy `node`'s pages from index `first` on (about to leave the pool) to the first tier, if not there yet."""
        if self.host is None and not self.store.writable:  # type: ignore[union-attr]
            return  # spilling is off (a write failed): eviction just drops the pages
        h = prefix_hasher(node.namespace)
        path = []
        up = node.parent
        while up is not None and up is not cache.root:
            path.append(up.token_bytes)
            up = up.parent
        h.update(b"".join(reversed(path)))
        if self.host is not None:
            self._spill_host(cache, node, first, h)
        else:
            self._spill_run(cache, node, first, h)

    def _prefixes(self, cache: RadixCache, node: TreeNode, h: xxhash.xxh3_128) -> list[int]:
        """The prefix digest of each of node's pages; `h` has hashed everything above the node and is left past it."""
        pb = 4 * cache.page_size
        out = []
        for i in range(len(node.pages)):
            h.update(node.token_bytes[i * pb : (i + 1) * pb])
            out.append(h.intdigest())
        return out

    def _spill_host(self, cache: RadixCache, node: TreeNode, first: int, h: xxhash.xxh3_128) -> None:
        host = self.host
        assert host is not None
        prefixes = self._prefixes(cache, node, h)[first:]
        entries = [(k, p, node.namespace) for k, p in zip(node.keys[first:], prefixes)]
        self.host_stats.spilled_pages += host.put(entries, node.pages[first:], self._cascade)
        host.touch(reversed(node.keys[first:]))
        # A run longer than the whole host tier: its deepest pages go straight to disk.
        rest = [(e, p) for e, p in zip(entries, node.pages[first:]) if not host.lookup(e[0], e[1])]
        if rest and self.store is not None:
            kv = self._gather([p for _, p in rest])
            self._cascade([(*e, page_kv) for (e, _), page_kv in zip(rest, kv)])

    def _cascade(self, pages: list[tuple[int, int, str, torch.Tensor]]) -> None:
        """Write pages (key, prefix, namespace, CPU KV) the disk tier lacks, in the order given, until a write fails:
        the host tier's LRU end, a run too long for it, and tree pages spilled straight to disk."""
        store = self.store
        if store is None:
            return
        for key, prefix, namespace, kv in pages:
            if not store.writable:
                return
            if not store.lookup(key, prefix):
                if not store.put(key, prefix, _bytes(kv), namespace):
                    return
                self.stats.spilled_pages += 1

    def _spill_run(self, cache: RadixCache, node: TreeNode, first: int, h: xxhash.xxh3_128) -> None:
        """Spill node.pages[first:] to disk; `h` has hashed everything above the node and is left past its end."""
        store = self.store
        assert store is not None
        prefixes = self._prefixes(cache, node, h)[first:]
        todo = [
            (k, p, page)
            for k, p, page in zip(node.keys[first:], prefixes, node.pages[first:])
            if not store.lookup(k, p)
        ]
        if todo and store.writable:  # (a full or read-only disk: nothing to gather)
            kv = self._gather([page for _, _, page in todo])
            # Deepest first, so that a disk tier too small for the run drops its tail, not its head.
            self._cascade([(k, p, node.namespace, page_kv) for (k, p, _), page_kv in zip(reversed(todo), kv.flip(0))])
        # Ancestors most recent: the LRU end of the disk tier holds a prefix's tail, rarely a page whose parent is gone.
        store.touch(reversed(node.keys[first:]))

    def _gather(self, pages: list[int]) -> torch.Tensor:
        """[n, 2, layers, page_size, kv_heads, head_dim] on the CPU, contiguous."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        return self.pool.gather_pages(idx).cpu().contiguous()

    def persist(self, cache: RadixCache) -> None:
        """Write every host-tier and tree page the disk tier lacks, then the index (shutdown and periodic
        checkpoints); nothing without a disk tier."""
        if self.store is None:
            return
        if self.host is not None:  # write-back: the host tier's pages would not survive the process
            self._cascade([(k, e.prefix, e.namespace, self.host.cpu_view(e.slot)) for k, e in self.host.items()])
        order: list[tuple[TreeNode, xxhash.xxh3_128]] = []  # parents before children, each with its prefix's hash
        stack = [(child, prefix_hasher(child.namespace)) for child in cache.root.children.values()]
        while stack:
            node, h = stack.pop()
            order.append((node, h.copy()))
            h.update(node.token_bytes)
            stack.extend((c, h.copy()) for c in node.children.values())
        for node, h in reversed(order):  # children first: parents end up the most recently used on disk
            if not self.store.writable:
                break
            self._spill_run(cache, node, 0, h)
        if self.store.dirty:
            self.store.save_index()

    # ---- load ------------------------------------------------------------------------------------------------
    def _held(self, key: int, prefix: int) -> bool:
        return (self.host is not None and self.host.lookup(key, prefix)) or (
            self.store is not None and self.store.lookup(key, prefix)
        )

    def load_prefix(self, cache: RadixCache, tokens: list[int], namespace: str) -> int:
        """Load the tiers' continuation of the tree's match of `tokens` into the pool and the tree; returns pages
        loaded. The cap is match_prefix's: never the whole prompt."""
        ps = cache.page_size
        pb = 4 * ps
        n_pages = max(0, (len(tokens) - 1) // ps)
        m = cache.match_prefix(tokens, namespace)
        have = len(m.pages)
        if have >= n_pages:
            return 0
        tb = as_bytes(tokens[: n_pages * ps])
        key = cache.root_key(namespace) if m.node is cache.root else m.node.keys[-1]
        h = prefix_hasher(namespace)
        h.update(tb[: have * pb])
        found: list[tuple[int, int]] = []
        for i in range(have, n_pages):
            page = tb[i * pb : (i + 1) * pb]
            key = cache.next_key(key, page)
            h.update(page)
            prefix = h.intdigest()
            if not self._held(key, prefix):
                break
            found.append((key, prefix))
        if not found:
            return 0
        for tier in (self.host, self.store):  # the spills that make room must not drop them
            if tier is not None:
                tier.touch(k for k, _ in reversed(found))
        cache.lock(m.node)  # making room must not evict the matched path
        try:
            pages = self._alloc(cache, len(found))
            n = self._fill(pages, found[: len(pages)])
            self.pool.free(pages[n:])
            pages = pages[:n]
            if n:
                res = cache.insert(tokens[: (have + n) * ps], m.pages + pages, namespace)
                self.pool.free(pages[max(len(res.pages) - have, 0) :])  # a hash collision stopped the insert
                n = max(len(res.pages) - have, 0)
        finally:
            cache.unlock(m.node)
        return n

    def _fill(self, pages: list[int], found: list[tuple[int, int]]) -> int:
        """Copy the found pages into pool `pages` (host slots, then disk files, up to the first that fails its
        checks); returns how many were filled."""
        t0 = time.perf_counter()
        host_rows: list[int] = []
        slots: list[int] = []
        disk_rows: list[int] = []
        payloads: list[memoryview] = []
        for row, (key, prefix) in enumerate(found):
            slot = self.host.slot(key, prefix) if self.host is not None else None
            data = self.store.get(key, prefix) if slot is None and self.store is not None else None
            if slot is not None:
                host_rows.append(row)
                slots.append(slot)
            elif data is not None:
                disk_rows.append(row)
                payloads.append(data)
            else:
                break
        n = len(host_rows) + len(disk_rows)
        if not n:
            return 0
        lay = self.layout
        kv = torch.empty((n, *lay.page_shape), dtype=self.pool.dtype, device=self.pool.device)
        if disk_rows:
            raw = np.frombuffer(b"".join(payloads), dtype=np.uint8)
            disk_kv = torch.from_numpy(raw.copy()).view(self.pool.dtype).view(len(disk_rows), *lay.page_shape)
            kv[torch.tensor(disk_rows, device=self.pool.device)] = disk_kv.to(self.pool.device)
        t1 = time.perf_counter()
        if host_rows:
            assert self.host is not None
            self.host.copy_out(host_rows, slots, kv)
        t2 = time.perf_counter()
        self.pool.scatter_pages(torch.tensor(pages[:n], dtype=torch.int64, device=self.pool.device), kv)
        per_page = (time.perf_counter() - t2) / n  # the shared scatter into the pool, split by pages
        self._count(self.stats, len(disk_rows), (t1 - t0) + per_page * len(disk_rows))  # reads, checks, copy
        self._count(self.host_stats, len(host_rows), (t2 - t1) + per_page * len(host_rows))
        return n

    def _count(self, stats: TierStats, n: int, seconds: float) -> None:
        if n:
            stats.loaded_pages += n
            stats.hit_tokens += n * self.pool.page_size
            stats.load_seconds += seconds

    def _alloc(self, cache: RadixCache, n: int) -> list[int]:
        """Up to n pool pages, evicting unlocked leaves if the free list is short."""
        pages = self.pool.alloc(n)
        if pages is None:
            cache.evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(min(n, self.pool.num_free_pages))
        return pages or []

    # ---- maintenance -----------------------------------------------------------------------------------------
    def clear(self) -> None:
        for tier in (self.host, self.store):
            if tier is not None:
                tier.clear()

    def drop_namespaces(self, accept: Callable[[str], bool]) -> int:
        """Drop the host and disk pages of the namespaces `accept` takes; returns how many (a page in both tiers
        counts twice)."""
        return sum(t.drop_namespaces(accept) for t in (self.host, self.store) if t is not None)

    def close(self, cache: RadixCache) -> None:
        """Shutdown: the host pages go to disk (when there is a disk tier), then the host buffer is freed."""
        if self.store is not None and not self.store.closed:
            self.persist(cache)
            self.store.close()
        if self.host is not None:
            self.host.release()

    def snapshot(self) -> dict[str, float | int | bool]:
        s, host = self.stats, self.host
        d = self.store
        return {
            "disk_pages": d.num_pages if d else 0,
            "disk_bytes": d.bytes if d else 0,
            "disk_limit_bytes": d.limit_bytes if d else 0,
            "disk_writable": d.writable if d else False,
            "disk_hit_tokens": s.hit_tokens,
            "spilled_pages": s.spilled_pages,
            "loaded_pages": s.loaded_pages,
            "load_seconds": s.load_seconds,
            "load_seconds_per_page": s.load_seconds / s.loaded_pages if s.loaded_pages else 0.0,
            "disk_bad_files": d.stats.bad_files if d else 0,
            "disk_lru_evicted_pages": d.stats.lru_evicted_pages if d else 0,
            "disk_write_errors": d.stats.write_errors if d else 0,
            "host_pages": host.num_pages if host else 0,
            "host_bytes": host.bytes if host else 0,
            "host_limit_bytes": host.limit_bytes if host else 0,
            "host_lru_evicted_pages": host.stats.lru_evicted_pages if host else 0,
            **self.host_stats.snapshot("host"),
        }


def _bytes(kv: torch.Tensor) -> memoryview:
    """One page's KV (a CPU tensor) as flat raw bytes, for a page file."""
    return kv.view(torch.uint8).reshape(-1).numpy().data


def open_tier(
    directory: str | Path | None,
    disk_gb: float,
    host_gb: float | None,
    model_path: str | Path,
    quantization: str,
    pool: KVPool,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> KVTier | None:
    """The host and disk tiers for this engine (host_tier_bytes says when the host tier is on; the disk tier is on
    with a directory), or None when neither is. A directory that cannot be used is left out with a warning; one
    another process holds raises TierLockedError."""
    fmt = pool.format
    storage = dtype_name(pool.dtype)
    layout = KVLayout(
        num_layers,
        pool.page_size,
        num_kv_heads,
        head_dim,
        storage,
        pool.dtype.itemsize,
        fmt.name,
        fmt.key_width(head_dim),
        fmt.value_width(head_dim),
        dtype_name(pool.compute_dtype),
    )
    host_bytes = host_tier_bytes(host_gb, pool, layout.page_bytes)
    host = HostTier(host_bytes, layout, pool) if host_bytes >= layout.page_bytes else None
    if host is not None:
        pinned = " pinned" if host.buf.is_pinned() else ""
        log.info("kv host tier: %d pages (%.1f MB%s)", host.capacity, host.limit_bytes / 1e6, pinned)
    store = None
    if directory is not None:
        try:
            store = DiskTier(
                directory, int(disk_gb * (1 << 30)), kv_digest(model_path, quantization, layout), layout.page_bytes
            )
        except TierLockedError:
            raise
        except OSError as exc:
            log.warning("kv cache dir %s is unusable (%s): running without the disk tier", directory, exc)
        else:
            log.info(
                "kv cache dir %s: %d pages (%.1f MB) from earlier runs", store.dir, store.num_pages, store.bytes / 1e6
            )
    if host is None and store is None:
        return None
    return KVTier(store, pool, layout, host)
