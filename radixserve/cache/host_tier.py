"""The host-RAM tier: KV pages that left a GPU's pool, in one pinned buffer of page slots with a size limit and LRU.

It sits between the device pool and the disk tier (kv_tier.py drives both): eviction copies pages device -> host, the
host's LRU end cascades on to disk, and a later match copies them host -> device before the request's prefill. A page
is named like on disk: its chained tree key, confirmed by the 128-bit digest of its namespace and whole prefix; the
buffer belongs to one engine, so one model and layout (the disk tier's digest is not needed here).

On CUDA the buffer is pinned and every spill is one batch: the pages are gathered on the compute stream (so the pool
may reuse them at once), then copied to their slots with non_blocking copies on a side stream that first waits for
the compute stream (so it never overwrites a slot a load is still reading). Loads wait for the side stream's last
event on the GPU; reading a slot on the CPU (the cascade to disk) synchronizes with it. Without CUDA every copy is
synchronous, which is how the tests in CI exercise this logic (the CUDA path is small and marked as such below).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from radixserve.host_memory import available_ram
from radixserve.cache.kv_digest import KVLayout
from radixserve.cache.kv_pool import KVPool


AUTO_POOL_MULTIPLE = 2  # the automatic size on CUDA: twice the device pool (SGLang's HiCache default ratio) ...
AUTO_RAM_SHARE = 0.25  # ... but at most this share of the RAM available at start


def host_tier_bytes(setting: float | None, pool: KVPool, page_bytes: int) -> int:
    """--kv-cache-host-gb: None is automatic (on for a CUDA pool, off on the CPU, where the pool already is host
    RAM); 0 is off; a size forces the tier on, on the CPU too (how CI tests it)."""
    if setting is not None:
        return int(setting * (1 << 30))
    if pool.device.type != "cuda":
        return 0
    return int(min(AUTO_POOL_MULTIPLE * pool.capacity * page_bytes, AUTO_RAM_SHARE * available_ram()))


@dataclass
class HostEntry:
    prefix: int  # xxh3_128 of the page's namespace and full prefix
    namespace: str  # for per-namespace flush
    slot: int  # row of the buffer


@dataclass
class HostStats:
    lru_evicted_pages: int = 0  # pages that left the host tier for room (on to disk when there is one)


# A page leaving the host LRU: (key, prefix, namespace, its KV as a CPU tensor valid until the callback returns).
Cascade = Callable[[list[tuple[int, int, str, torch.Tensor]]], None]


def _runs(rows: list[int], slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """(row, slot, length) for the runs where both rows and slots are consecutive: one copy each."""
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1 and slots[j] == slots[j - 1] + 1:
            j += 1
        yield rows[i], slots[i], j - i
        i = j


class HostTier:
    def __init__(self, limit_bytes: int, layout: KVLayout, pool: KVPool) -> None:
        self.layout = layout
        self.pool = pool
        self.device = pool.device
        self.capacity = max(limit_bytes // layout.page_bytes, 0)
        cuda = pool.device.type == "cuda"
        self.buf = torch.empty((self.capacity, *layout.page_shape), dtype=pool.dtype, pin_memory=cuda)
        self.index: OrderedDict[int, HostEntry] = OrderedDict()  # oldest first
        self._free = list(range(self.capacity - 1, -1, -1))
        self.stats = HostStats()
        # CUDA only (untested in CI): the copy stream and the event of its last spill.
        self._stream = torch.cuda.Stream(pool.device) if cuda else None
        self._event: torch.cuda.Event | None = None

    # ---- lookups ---------------------------------------------------------------------------------------------
    def slot(self, key: int, prefix: int) -> int | None:
        e = self.index.get(key)
        return e.slot if e is not None and e.prefix == prefix else None

    def lookup(self, key: int, prefix: int) -> bool:
        return self.slot(key, prefix) is not None

    def touch(self, keys: Iterable[int]) -> None:
        """Mark pages most recently used, in the order given (descendants before ancestors, as on disk)."""
        for k in keys:
            if k in self.index:
                self.index.move_to_end(k)

    # ---- device -> host --------------------------------------------------------------------------------------
    def put(self, entries: list[tuple[int, int, str]], pool_pages: list[int], cascade: Cascade | None) -> int:
        """Copy pool pages (entries: key, prefix, namespace; root side first) into free or LRU slots; pages past
        the capacity are left out (the deepest). Returns pages stored; the LRU pages that make room go to
        `cascade` first."""
        todo = [(e, p) for e, p in zip(entries, pool_pages) if not self.lookup(e[0], e[1])][: self.capacity]
        if not todo:
            return 0
        self._make_room(len(todo), cascade)
        slots = [self._free.pop() for _ in todo]
        for ((key, prefix, ns), _), slot in zip(todo, slots):
            old = self.index.pop(key, None)  # same key, another prefix (a 64-bit collision): the newer page wins
            if old is not None:
                self._free.append(old.slot)
            self.index[key] = HostEntry(prefix, ns, slot)
        self._copy_in(slots, [p for _, p in todo])
        return len(todo)

    def _copy_in(self, slots: list[int], pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        if self._stream is None:
            self.buf[torch.tensor(slots)] = self.pool.gather_pages(idx)
            return
        # CUDA: gather on the compute stream, copy on the side stream (see the module docstring).
        kv = self.pool.gather_pages(idx)
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            for row, slot, n in _runs(list(range(len(slots))), slots):
                self.buf[slot : slot + n].copy_(kv[row : row + n], non_blocking=True)
            kv.record_stream(self._stream)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    # ---- host -> device --------------------------------------------------------------------------------------
    def copy_out(self, rows: list[int], slots: list[int], dst: torch.Tensor) -> None:
        """dst[rows[i]] = the page in slots[i]; dst is on the pool's device (non_blocking from pinned memory)."""
        if self._event is not None:  # a spill still copying into a slot read here (a page evicted, then wanted)
            torch.cuda.current_stream(self.device).wait_event(self._event)
        for row, slot, n in _runs(rows, slots):
            dst[row : row + n].copy_(self.buf[slot : slot + n], non_blocking=self._stream is not None)

    # ---- room and removal ------------------------------------------------------------------------------------
    def _make_room(self, n: int, cascade: Cascade | None) -> None:
        need = n - len(self._free)
        if need <= 0:
            return
        victims = [self.index.popitem(last=False) for _ in range(need)]
        self.stats.lru_evicted_pages += need
        if cascade is not None:
            cascade([(k, e.prefix, e.namespace, self.cpu_view(e.slot)) for k, e in victims])
        self._free.extend(e.slot for _, e in victims)

    def cpu_view(self, slot: int) -> torch.Tensor:
        """A slot's page on the CPU, after every pending spill copy into the buffer is done."""
        if self._event is not None:
            self._event.synchronize()
        return self.buf[slot]

    def drop_namespaces(self, accept: Callable[[str], bool]) -> int:
        """Forget every page of the namespaces `accept` takes; returns how many."""
        gone = [k for k, e in self.index.items() if accept(e.namespace)]
        for k in gone:
            self._free.append(self.index.pop(k).slot)
        return len(gone)

    def clear(self) -> None:
        self._free.extend(e.slot for e in self.index.values())
        self.index.clear()

    def release(self) -> None:
        """Free the buffer at shutdown (the tier is empty after). On CUDA torch's host allocator would keep the pinned
        block cached for the process, up to a quarter of its RAM held after the engine is gone, so it is emptied."""
        if self._event is not None:
            self._event.synchronize()  # a spill's copies still write into the buffer
        self.index.clear()
        self._free.clear()
        self.capacity = 0
        self.buf = self.buf.new_empty((0, *self.buf.shape[1:]))
        if self._stream is not None:
            # public in newer torch (2.13 here); 2.5-2.11 (the H200 machine has 2.11) have only the private name.
            empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    def items(self) -> list[tuple[int, HostEntry]]:
        """Every page, least recently used first."""
        return list(self.index.items())

    @property
    def num_pages(self) -> int:
        return len(self.index)

    @property
    def bytes(self) -> int:
        return len(self.index) * self.layout.page_bytes

    @property
    def limit_bytes(self) -> int:
        return self.capacity * self.layout.page_bytes
