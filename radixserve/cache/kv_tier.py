"""The second tier under the radix tree: pages evicted from the pool go to a DiskTier, and a later match continues
into it, loading the pages back into the pool (one batched copy per layer) before the request's prefill.

A page in the tier is named by its chained tree key and confirmed by the 128-bit digest of its namespace and whole
prefix, so a hit is exact (a 64-bit key collision is a miss) and namespaces never meet. The tier is inclusive: a page
loaded back keeps its file, so evicting it again writes nothing. RadixCache calls `spill` from evict(); the
scheduler calls `load_prefix` before it matches a request it is about to admit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from radixserve.cache.disk_tier import DiskTier, TierLockedError
from radixserve.cache.kv_digest import KVLayout, kv_digest
from radixserve.cache.kv_pool import KVPool

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache, TreeNode

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    spilled_pages: int = 0  # pages written to the tier on eviction or checkpoint
    loaded_pages: int = 0  # pages loaded back into the pool
    load_seconds: float = 0.0
    hit_tokens: int = 0  # prompt tokens served by pages loaded from the tier


def prefix_hasher(namespace: str) -> xxhash.xxh3_128:
    h = xxhash.xxh3_128()
    h.update(namespace.encode("utf-8") + b"\0")
    return h


class KVTier:
    def __init__(self, store: DiskTier, pool: KVPool, layout: KVLayout) -> None:
        self.store = store
        self.pool = pool
        self.layout = layout
        self.stats = TierStats()

    # ---- pool <-> bytes --------------------------------------------------------------------------------------
    def _gather(self, pages: list[int]) -> torch.Tensor:
        """[n, 2, layers, page_size, kv_heads, head_dim] on the CPU, contiguous."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        k = torch.stack([b.index_select(0, idx) for b in self.pool.k_buffers], 1)
        v = torch.stack([b.index_select(0, idx) for b in self.pool.v_buffers], 1)
        return torch.stack([k, v], 1).cpu().contiguous()

    def _scatter(self, pages: list[int], payloads: list[memoryview]) -> None:
        lay = self.layout
        raw = np.frombuffer(b"".join(payloads), dtype=np.uint8)
        kv = torch.from_numpy(raw.copy()).view(self.pool.dtype).view(len(pages), *lay.page_shape)
        kv = kv.to(self.pool.device)
        idx = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        for layer, (kb, vb) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            kb.index_copy_(0, idx, kv[:, 0, layer])
            vb.index_copy_(0, idx, kv[:, 1, layer])

    # ---- spill -----------------------------------------------------------------------------------------------
    def spill(self, cache: RadixCache, node: TreeNode, first: int) -> None:
        """Write `node`'s pages from index `first` on (about to leave the pool) to the tier, if not there yet."""
        if not self.store.writable:
            return  # spilling is off (a write failed): eviction just drops the pages
        h = prefix_hasher(node.namespace)
        path = []
        up = node.parent
        while up is not None and up is not cache.root:
            path.append(up.token_bytes)
            up = up.parent
        h.update(b"".join(reversed(path)))
        self._spill_run(cache, node, first, h)

    def _spill_run(self, cache: RadixCache, node: TreeNode, first: int, h: xxhash.xxh3_128) -> None:
        """Spill node.pages[first:]; `h` has hashed everything above the node and is left past its last page."""
        pb = 4 * cache.page_size
        todo: list[tuple[int, int, int]] = []  # (key, prefix, pool page)
        for i, (key, page) in enumerate(zip(node.keys, node.pages)):
            h.update(node.token_bytes[i * pb : (i + 1) * pb])
            if i >= first and self.store.writable and not self.store.lookup(key, prefix := h.intdigest()):
                todo.append((key, prefix, page))
        if todo:
            kv = self._gather([p for _, _, p in todo])
            # Deepest first, so that a disk tier too small for the run drops its tail, not its head.
            for (key, prefix, _), page_kv in zip(reversed(todo), kv.flip(0)):
                if not self.store.put(key, prefix, page_kv.view(torch.uint8).reshape(-1).numpy().data):
                    break
                self.stats.spilled_pages += 1
        # Ancestors most recent: the LRU end of the disk tier holds a prefix's tail, rarely a page whose parent is gone.
        self.store.touch(reversed(node.keys[first:]))

    def persist(self, cache: RadixCache) -> None:
        """Write every tree page the tier lacks, then the index (shutdown and periodic checkpoints)."""
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
    def load_prefix(self, cache: RadixCache, tokens: list[int], namespace: str) -> int:
        """Load the tier's continuation of the tree's match of `tokens` into the pool and the tree; returns pages
        loaded. The cap is match_prefix's: never the whole prompt."""
        ps = cache.page_size
        pb = 4 * ps
        n_pages = max(0, (len(tokens) - 1) // ps)
        m = cache.match_prefix(tokens, namespace)
        have = len(m.pages)
        if have >= n_pages:
            return 0
        tb = np.asarray(tokens[: n_pages * ps], dtype="<i4").tobytes()
        key = cache.root_key(namespace) if m.node is cache.root else m.node.keys[-1]
        h = prefix_hasher(namespace)
        h.update(tb[: have * pb])
        found: list[tuple[int, int]] = []
        for i in range(have, n_pages):
            page = tb[i * pb : (i + 1) * pb]
            key = cache.next_key(key, page)
            h.update(page)
            prefix = h.intdigest()
            if not self.store.lookup(key, prefix):
                break
            found.append((key, prefix))
        if not found:
            return 0
        self.store.touch(k for k, _ in reversed(found))  # the spills that make room must not drop them
        t0 = time.perf_counter()
        cache.lock(m.node)  # making room must not evict the matched path
        try:
            pages = self._alloc(cache, len(found))
            payloads = []
            for key, prefix in found[: len(pages)]:
                data = self.store.get(key, prefix)
                if data is None:
                    break
                payloads.append(data)
            n = len(payloads)
            self.pool.free(pages[n:])
            pages = pages[:n]
            if n:
                self._scatter(pages, payloads)
                res = cache.insert(tokens[: (have + n) * ps], m.pages + pages, namespace)
                self.pool.free(pages[max(len(res.pages) - have, 0) :])  # a hash collision stopped the insert
                n = max(len(res.pages) - have, 0)
        finally:
            cache.unlock(m.node)
        self.stats.loaded_pages += n
        self.stats.hit_tokens += n * ps
        self.stats.load_seconds += time.perf_counter() - t0
        return n

    def _alloc(self, cache: RadixCache, n: int) -> list[int]:
        """Up to n pool pages, evicting unlocked leaves if the free list is short."""
        pages = self.pool.alloc(n)
        if pages is None:
            cache.evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(min(n, self.pool.num_free_pages))
        return pages or []

    # ---- maintenance -----------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.store.clear()

    def close(self, cache: RadixCache) -> None:
        if self.store.closed:
            return
        self.persist(cache)
        self.store.close()

    def snapshot(self) -> dict[str, float | int | bool]:
        s, d = self.stats, self.store.stats
        return {
            "disk_pages": self.store.num_pages,
            "disk_bytes": self.store.bytes,
            "disk_limit_bytes": self.store.limit_bytes,
            "disk_writable": self.store.writable,
            "disk_hit_tokens": s.hit_tokens,
            "spilled_pages": s.spilled_pages,
            "loaded_pages": s.loaded_pages,
            "load_seconds": s.load_seconds,
            "load_seconds_per_page": s.load_seconds / s.loaded_pages if s.loaded_pages else 0.0,
            "disk_bad_files": d.bad_files,
            "disk_lru_evicted_pages": d.lru_evicted_pages,
            "disk_write_errors": d.write_errors,
        }


def open_tier(
    directory: str | Path,
    disk_gb: float,
    model_path: str | Path,
    quantization: str,
    pool: KVPool,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> KVTier | None:
    """The disk tier for this engine, or None (with a warning) if the directory cannot be used; TierLockedError
    when another process holds it."""
    layout = KVLayout(
        num_layers, pool.page_size, num_kv_heads, head_dim, str(pool.dtype).removeprefix("torch."), pool.dtype.itemsize
    )
    digest = kv_digest(model_path, quantization, layout)
    try:
        store = DiskTier(directory, int(disk_gb * (1 << 30)), digest, layout.page_bytes)
    except TierLockedError:
        raise
    except OSError as exc:
        log.warning("kv cache dir %s is unusable (%s): running without the disk tier", directory, exc)
        return None
    log.info("kv cache dir %s: %d pages (%.1f MB) from earlier runs", store.dir, store.num_pages, store.bytes / 1e6)
    return KVTier(store, pool, layout)
