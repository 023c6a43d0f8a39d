"""The cache manager: where a request's pages come from (the free list, else evicting the tree and kept partial
pages), how they go to the radix tree (after each prefill chunk and at finish) and back to the pool, and the check
that every page is accounted for (rule 2 of docs/DESIGN.md).

A mixin of `Scheduler` (it works on the scheduler's pool, cache, queues and runner slots)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.cache.radix_cache import RadixCache
from radixserve.request import Req, ReqStatus

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from radixserve.cache.kv_pool import KVPool
    from radixserve.cache.null_cache import NullCache
    from radixserve.cache.partial_page import PartialPages
    from radixserve.cache.pins import PinTable
    from radixserve.scheduler.scheduler import SchedulerConfig


@dataclass(frozen=True)
class PoolStates:
    """Every page of the KV pool in exactly one state (the five sum to `total`): the one definition that /metrics,
    /cache/stats and the dashboard all report."""

    total: int
    free: int
    tree_evictable: int  # in the radix tree, held by no request and no pin
    tree_locked: int  # in the radix tree, held by a running request or a pin
    partial_kept: int  # a finished request's partial page, kept for later requests to copy rows from
    private: int  # held by a running request outside the tree (KV not inserted yet, its own partial page)

    @property
    def cached(self) -> int:
        """Pages whose KV a later request can reuse: the tree's and the kept partial pages."""
        return self.tree_evictable + self.tree_locked + self.partial_kept

    @property
    def evictable(self) -> int:
        """Cached pages that can be taken back on demand (kept partial pages go first)."""
        return self.tree_evictable + self.partial_kept


class PageKeeping:
    cfg: SchedulerConfig
    pool: KVPool
    cache: RadixCache | NullCache
    partial: PartialPages | None
    pins: PinTable
    waiting: deque[Req]
    running: list[Req]
    finishing: list[Req]
    _free_slots: list[int]
    # and Scheduler's has_work, PartialReuse's _note_tail and partial_pages

    def _alloc(self, n: int) -> list[int] | None:
        """n pool pages, evicting unlocked radix-tree leaves if the free list is short."""
        if n == 0:
            return []
        pages = self.pool.alloc(n)
        if pages is None:
            short = n - self.pool.num_free_pages
            if self.partial is not None:  # kept partial pages go first: each saves less than a full page
                short -= self.partial.evict(short)
            self.cache.evict(short)
            pages = self.pool.alloc(n)
        return pages

    def _insert(self, req: Req) -> None:
        """Give the request's computed full pages to the tree, point its page table at the tree's copies, and record
        the computed tokens of its partial page after them for other requests to copy."""
        self._insert_full(req)
        if self.partial is not None:
            self._note_tail(req)

    def _insert_full(self, req: Req) -> None:
        ps = self.cfg.page_size
        # Only KV that processed steps computed is cached: a step still in flight may yet fail (see fail_batches),
        # and kv_len may count a token still being sampled (overlap), which cannot be keyed.
        n_full = min(req.kv_len - req.kv_inflight, req.num_fill) // ps
        if n_full <= req.num_tree_pages:
            return
        res = self.cache.insert(req.fill_ids[: n_full * ps], req.pages[:n_full], req.namespace)
        req.pages[: len(res.pages)] = res.pages
        if len(res.pages) <= req.num_tree_pages:
            return  # a hash collision stopped the insert where the request's tree pages already end
        self.cache.lock(res.node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node = res.node
        req.num_tree_pages = len(res.pages)

    def _release(self, req: Req) -> None:
        """Cache what the request computed, free its private pages and its lock; it then holds nothing."""
        self._insert(req)
        if req.retention is not None and req.node is not None and req.finished and not req.failed:
            self.cache.retain(req.node, req.retention)  # before its lock goes: nothing evicts it in between
        private = req.pages[req.num_tree_pages :]
        if req.tail is not None:
            assert self.partial is not None
            if self.partial.release(req.tail, keep=True):  # the registry keeps the page for later requests
                private.remove(req.tail.page)
            req.tail = None
        self.pool.free(private)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.pages, req.node, req.num_tree_pages, req.kv_len = [], None, 0, 0
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def pool_states(self) -> PoolStates:
        """The pool's pages by state (call on the loop thread, or where the scheduler does not move)."""
        free, kept = self.pool.num_free_pages, self.partial_pages
        evictable, locked = self.cache.evictable_pages, self.cache.protected_pages
        private = self.pool.capacity - free - evictable - locked - kept  # check_invariants counts them one by one
        return PoolStates(self.pool.capacity, free, evictable, locked, kept, private)

    # ---- maintenance ------------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        if self.partial is not None:
            self.partial.reset()
        if isinstance(self.cache, RadixCache):
            self.pins.clear(self.cache)
        self.cache.reset()
        if self.cache.tier is not None:
            self.cache.tier.clear()
        return True

    def flush_namespaces(self, accept: Callable[[str], bool]) -> int:
        """Drop the unlocked pool pages and every host and disk page of the namespaces `accept` takes, whatever runs;
        returns how many (a page held in two tiers counts twice)."""
        dropped = self.cache.flush_namespaces(accept)
        return dropped + (self.cache.tier.drop_namespaces(accept) if self.cache.tier is not None else 0)

    def check_invariants(self) -> None:
        """Every page is free, in the tree, or private to exactly one running request; lock counts add up."""
        self.cache.check_invariants()
        if self.partial is not None:
            self.partial.check_invariants()
        holders = self.running + self.finishing
        private = [p for r in holders for p in r.pages[r.num_tree_pages :]]
        assert len(private) == len(set(private)), "a private page is held by two requests"
        kept = self.partial_pages
        total = self.pool.num_free_pages + self.cache.total_pages + kept + len(private)
        assert total == self.pool.capacity, (
            f"page leak: free {self.pool.num_free_pages} + tree {self.cache.total_pages} + kept partial {kept} "
            f"+ private {len(private)} != capacity {self.pool.capacity}"
        )
        for queue, status in (
            (self.waiting, ReqStatus.WAITING),
            (self.running, ReqStatus.RUNNING),
            (self.finishing, ReqStatus.FINISHING),
        ):
            assert all(r.status is status for r in queue), f"every request in {status.value} has that status"
        for r in self.waiting:
            assert not r.pages and r.node is None and r.tail is None, f"waiting request {r.rid} holds pages"
        if not holders:
            pinned = len(self.pins.pinned_pages(self.cache)) if isinstance(self.cache, RadixCache) else 0
            assert self.cache.protected_pages == pinned, "no request runs, yet tree pages other than pins are locked"
            assert len(self._free_slots) == self.cfg.max_running_requests, "a runner slot leaked"
