"""Partial-page reuse on the scheduler's side: record each request's partial page for others (live, then kept at its
end), find the rows a new request may copy, and plan a step's copies. The registry itself is cache/partial_page.py.

A mixin of `Scheduler` (it works on the scheduler's requests, cache and copy plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.cache.partial_page import PartialHit, PartialPages
from radixserve.request import Req
from radixserve.step import ScheduledBatch

if TYPE_CHECKING:
    from radixserve.cache.null_cache import NullCache
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.scheduler.scheduler import SchedulerConfig


class PartialReuse:
    cfg: SchedulerConfig
    cache: RadixCache | NullCache
    partial: PartialPages | None
    _copies: dict[int, tuple[int, int, int]]

    @property
    def partial_pages(self) -> int:
        """Partial pages kept for reuse (cached and evictable, outside the tree's count)."""
        return 0 if self.partial is None else self.partial.kept_pages

    def _boundary_key(self, node: Any, namespace: str) -> int:
        """Key of the last full page of `node` (the namespace's root key for the root): where tails hang."""
        return self.cache.root_key(namespace) if node is self.cache.root else node.keys[-1]

    def _note_tail(self, req: Req) -> None:
        assert self.partial is not None
        ps = self.cfg.page_size
        computed = min(req.kv_len - req.kv_inflight, req.num_fill)
        n_full = computed // ps
        tokens, page = b"", 0
        if req.node is not None and n_full == req.num_tree_pages and len(req.pages) > n_full:
            tokens, page = np.asarray(req.fill_ids[n_full * ps : computed], dtype="<i4").tobytes(), req.pages[n_full]
        if not tokens and req.tail is None:
            return
        key = self._boundary_key(req.node, req.namespace) if tokens else 0
        req.tail = self.partial.note(req.tail, key, req.node, req.namespace, tokens, page, req)

    def _partial_hit(self, req: Req, node: Any, start: int) -> PartialHit | None:
        """Rows of a remembered partial page that continue the request's match past its full pages (`start`
        tokens), never the last token of what may be looked up (it must be computed for logits)."""
        if self.partial is None:
            return None
        ids = req.match_ids()
        limit = min(len(ids) - 1 - start, self.cfg.page_size - 1)
        if limit <= 0:
            return None
        query = np.asarray(ids[start : start + limit], dtype="<i4").tobytes()
        key = self._boundary_key(node, req.namespace)
        return self.partial.lookup(node, key, req.namespace, query, node is self.cache.root)

    def _plan_copies(self, batch: ScheduledBatch) -> None:
        """Flat pool slots of this step's partial-page copies: rows 0..n-1 of each source page, and only those."""
        ps = self.cfg.page_size
        src: list[int] = []
        dst: list[int] = []
        batch.copied = [0] * len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            copy = self._copies.get(id(req))
            if copy is None:
                continue
            s, d, n = copy
            src.extend(range(s * ps, s * ps + n))
            dst.extend(range(d * ps, d * ps + n))
            batch.copied[i] = n
        batch.copy_src = torch.tensor(src, dtype=torch.int64)
        batch.copy_dst = torch.tensor(dst, dtype=torch.int64)
        self._copies = {}
