"""Move a GGUF's mapped blocks onto transparent huge pages, in place, on a background thread (issue 38).

Why: a decode step reads ~390 MB of blocks. Mapped from the file they lie on 4 KiB pages (kernels built without
CONFIG_READ_ONLY_THP_FOR_FS map files no other way, whatever madvise asks), so each step crosses ~100k pages, far
more than a TLB holds (the likely cost; this VM has no counters to show it). On anonymous huge pages (~200 of them)
the same bytes decoded 6-11% faster in process and ~7% served (RESULTS.md, issue 38 session 23).

How: each run of whole 2 MiB pages under the blocks is copied into fresh anonymous memory advised MADV_HUGEPAGE,
made read-only, and moved over the old pages with mremap. The addresses stay, and so does every tensor over them;
the bytes stay too, so readers need no pause: a kernel reading a page while it moves faults, waits for the move
under the kernel's mmap lock and reads the new page. When the file's map is unmapped (its numpy array freed), the
moved pages go with it. The copy runs on a thread so that start-up does not wait for it (~1 s for the default
model in the VM measured, nearly all of it the first touches of the new pages); RSS grows by one run at most
meanwhile.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from radixserve.gguf.reader import PERMUTED_ARCHITECTURES
from radixserve.gguf.tensor_table import TensorTable, read_tensor_table

HUGE_PAGE = 2 << 20
_RUN_PAGES = 8  # huge pages copied per mremap: the most RSS the move adds at once (16 MiB)
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """True on Linux with transparent huge pages granted to madvised memory (the setting is not `[never]`), unless
    RADIXSERVE_HUGE_PAGES=0 (then the blocks stay on the file's pages)."""
    if os.environ.get("RADIXSERVE_HUGE_PAGES", "1") == "0" or sys.platform != "linux":
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    vp, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    libc.mmap.restype, libc.mmap.argtypes = vp, [vp, size, i, i, i, ctypes.c_long]
    libc.mremap.restype, libc.mremap.argtypes = vp, [vp, size, size, i, vp]
    for name in ("munmap", "madvise", "mprotect"):
        getattr(libc, name).argtypes = [vp, size] + ([i] if name != "munmap" else [])
    return libc


def page_runs(mapped: np.ndarray, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, bytes) of the runs of whole huge pages inside `mapped` that any (address, bytes) range touches,
    each at most _RUN_PAGES long; none when the map does not start on a huge page (then no page could be huge)."""
    base = mapped.ctypes.data
    if base % HUGE_PAGE:
        return []
    last = mapped.nbytes // HUGE_PAGE  # pages past the last whole one are left as they are
    pages = set()
    for addr, nbytes in ranges:
        lo, hi = (addr - base) // HUGE_PAGE, -(-(addr + nbytes - base) // HUGE_PAGE)
        pages.update(range(max(lo, 0), min(hi, last)))
    runs: list[tuple[int, int]] = []
    for p in sorted(pages):
        start, n = runs[-1] if runs else (-2, 0)
        if p == start + n and n < _RUN_PAGES:
            runs[-1] = (start, n + 1)
        else:
            runs.append((p, 1))
    return [(base + p * HUGE_PAGE, n * HUGE_PAGE) for p, n in runs]


def _move(libc: ctypes.CDLL, addr: int, size: int) -> None:
    """Copy [addr, addr + size) onto new huge pages and put them at addr (both 2 MiB-aligned)."""
    rw, anon = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    raw = libc.mmap(None, size + HUGE_PAGE, rw, anon, -1, 0)
    if raw in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    new = -(-raw // HUGE_PAGE) * HUGE_PAGE  # the run must start on a huge page to be mapped by them
    if new > raw:
        libc.munmap(raw, new - raw)
    libc.munmap(new + size, raw + HUGE_PAGE - new)
    libc.madvise(new, size, mmap.MADV_HUGEPAGE)
    ctypes.memmove(new, addr, size)
    libc.mprotect(new, size, mmap.PROT_READ)  # as the file's map: nothing may write the blocks
    if libc.mremap(new, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr) != addr:
        err = ctypes.get_errno()
        libc.munmap(new, size)
        raise OSError(err, "mremap failed")


class HugePageMover:
    """Moves `runs` (page_runs of `mapped`) on a daemon thread once started; `join()` waits for it. `moved` counts
    the bytes moved; a failed move (an old kernel, no memory) stops the rest and leaves the file's pages there."""

    def __init__(self, mapped: np.ndarray, runs: list[tuple[int, int]]) -> None:
        self.mapped = mapped  # held so the map outlives the thread's moves
        self.runs = runs
        self.moved = 0
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="radixserve-huge-pages", daemon=True)

    def start(self) -> HugePageMover:
        if self.runs:
            self._thread.start()
        return self

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        # Lowest priority: a request served meanwhile gets the cores (the first answer after start-up took 0.63 s
        # against 0.37 without the move when it ran at normal priority, benchmarks.startup).
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        libc = _libc()
        try:
            for addr, size in self.runs:
                _move(libc, addr, size)
                self.moved += size
        except OSError as e:
            self.error = e


def in_place_ranges(table: TensorTable) -> list[tuple[int, int]]:
    """(address, bytes) of the blocks a decode step reads from the map in place (radixserve/model/gguf_model.py):
    every quantized tensor but the token embedding, which is read a row per token (unless it is also the LM head),
    and but attn_q and attn_k of architectures whose rows are reordered (into copies) at load."""
    tied = "output.weight" not in table.tensors
    skipped = ("attn_q.", "attn_k.") if table.architecture in PERMUTED_ARCHITECTURES else ()
    return [
        (t.data.ctypes.data, t.data.nbytes)
        for name, t in table.tensors.items()
        if t.type.name not in ("F32", "F16", "BF16")
        and (tied or name != "token_embd.weight")
        and not any(s in name for s in skipped)
    ]


def start_moving(table: TensorTable) -> HugePageMover | None:
    """Start moving the table's in-place blocks onto huge pages; None where huge pages are not available."""
    if not available():
        return None
    return HugePageMover(table.mapped, page_runs(table.mapped, in_place_ranges(table))).start()


_early: tuple[Path, TensorTable, HugePageMover | None] | None = None


def start_early(gguf: Path) -> None:
    """Map the GGUF and start moving its blocks now, for the model load to take (`take_early`). A start that loads
    the model some other way (re-quantized, float32) leaves it to `drop_early`."""
    global _early
    table = read_tensor_table(gguf)
    _early = (gguf.resolve(), table, start_moving(table))


def keep_table(gguf: Path, table: TensorTable) -> None:
    """Leave a table read before the load (the engine's check of the file's block types) for `take_early`, with no
    move started: the load starts it."""
    global _early
    _early = (gguf.resolve(), table, None)


def take_early(gguf: Path) -> tuple[TensorTable, HugePageMover | None] | None:
    """The table and mover (None: none started) that `start_early` or `keep_table` left for this file, once; None if
    they left none."""
    global _early
    early, _early = _early, None
    if early is None or early[0] != Path(gguf).resolve():
        return None
    return early[1], early[2]


def early_table(gguf: Path) -> TensorTable | None:
    """The table `start_early` read for this file, left for `take_early`; None if it read none."""
    return _early[1] if _early is not None and _early[0] == gguf.resolve() else None


def drop_early() -> None:
    """Forget what `start_early` made and nobody took (its map is freed once its mover is done with it)."""
    global _early
    _early = None
