"""Admission: which waiting requests join this step, in what order (priority, fair share between tenants, then
the queue policy), with how many pages (their cached prefix matched and locked, a partial page's rows copied, room
reserved for their decode), and who gives way (priority and fair-share retraction, requests too big beside pins).

A mixin of `Scheduler` (it works on the scheduler's queues, cache, pool and page bookkeeping)."""

from __future__ import annotations

from radixserve.cache.partial_page import PartialHit
from radixserve.cache.radix_cache import MatchResult
from radixserve.io import FinishReason
from radixserve.request import Req, ReqStatus
from radixserve.scheduler.fairness import by_priority_only


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Admission:
    """The admission half of the Scheduler (see the module docstring); its state is the Scheduler's."""

    def _order(self, candidates: list[Req]) -> list[Req]:
        """Admission order: priority, then fair share between tenants (if on), then the queue policy."""
        within = list  # fcfs: arrival order
        if self.cache.enabled and self.cfg.schedule_policy == "lpm" and len(candidates) <= self.cfg.lpm_queue_limit:
            cached = {id(r): self.cache.match_prefix(r.match_ids(), r.namespace).num_tokens for r in candidates}

            def within(reqs: list[Req]) -> list[Req]:
                return sorted(reqs, key=lambda r: -cached[id(r)])  # stable: FCFS among equals

        if self.fair is not None:
            return self.fair.order(candidates, within, self.running)
        return by_priority_only(candidates, within)

    def _slots_full(self) -> bool:
        return len(self.running) + len(self.finishing) >= self.cfg.max_running_requests  # finishing hold a slot

    def _continue_prefills(self, chunks: dict[int, int]) -> int:
        """Start the step's prefill budget: the next chunks of running requests' unfinished prefills (each tenant
        within its fair-share room); returns what is left of the budget for new requests."""
        budget = self.cfg.chunked_prefill_size
        if self.fair is not None:
            self.fair.begin_step({r.tenant for r in self.running} | {r.tenant for r in self.waiting})
        for req in [r for r in self.running if r.pending > 1]:
            if budget <= 0:
                break
            chunk = min(req.pending, budget, self._room(req))
            if chunk <= 0 or not self._may_join(req, chunk, chunks):
                continue
            pages = self._alloc(_cdiv(req.kv_len + chunk, self.cfg.page_size) - len(req.pages))
            if pages is None:
                continue
            req.pages.extend(pages)
            chunks[id(req)] = chunk
            budget -= chunk
            if self.fair is not None:
                self.fair.charge(req.tenant, chunk)
        return budget

    def _may_join(self, req: Req, chunk: int, chunks: dict[int, int]) -> bool:
        """Whether `req`'s prefill chunk may join the step (`_may_merge`); with fair share on, also whenever the
        step's other prefills are all other tenants': each tenant's part of a step is bounded by its room, and
        waiting for a step free of them could take as long as another tenant's long prompts take to prefill."""
        if self._may_merge(chunk, chunks):
            return True
        if self.fair is None:
            return False
        return all(r.tenant != req.tenant for r in self.running if chunks.get(id(r), 0) > 1)

    def _room(self, req: Req) -> int:
        """Prefill tokens `req`'s tenant may still add to this step (fairness.FairShare.room)."""
        return self.fair.room(req.tenant) if self.fair is not None else self.cfg.chunked_prefill_size

    def _admit(self, budget: int, chunks: dict[int, int], can_retract: bool = True) -> int:
        ps = self.cfg.page_size
        cache_on = self.cache.enabled
        reserved = sum(self._reserve(r) for r in self.running)
        first_pages: set[tuple[str, int, tuple[int, ...]]] = set()
        first_rows: set[tuple[str, int, tuple[int, ...]]] = set()
        stuck: set[str] = set()  # tenants whose candidates find the slots full and can retract nobody
        head = True  # the first candidate that could run: never passed over by later ones
        for req in self._order(list(self.waiting)):
            if budget <= 0:
                break
            room = self._room(req)
            if room <= 0:
                continue  # its tenant has its share of this step; another tenant's candidate may still join
            if self._slots_full() and req.tenant in stuck:
                continue  # its tenant's earlier (no lower priority) candidate could retract nobody: nor can it
            took_slot = False
            while self._slots_full() and (freed := self._preempt(req, chunks, can_retract)) is not None:
                budget, took_slot = budget + freed, True  # priority or fair share took another's slot
            if self._slots_full():
                stuck.add(req.tenant)  # another tenant's candidate may still retract (fair share, priority)
                continue
            if self.pins.num_pinned and self._beside_pins(req):
                continue
            # Re-match: an eviction while admitting an earlier candidate may have shortened this match. Pages the
            # second tier holds past the tree's match come back into the pool first.
            if self.cache.tier is not None:
                self.cache.tier.load_prefix(self.cache, req.match_ids(), req.namespace)
            m = self.cache.match_prefix(req.match_ids(), req.namespace)
            matched_pages = m.pages
            start = len(matched_pages) * ps
            hit = self._partial_hit(req, m.node, start)
            copied = hit.num_tokens if hit is not None else 0
            # Two requests admitted together would both compute a prefix they share; hold the later one back a
            # step so it finds the first one's pages in the tree instead.
            fill = req.fill_ids
            nxt = (req.namespace, start, tuple(fill[start : start + ps]))
            # Below the page the same holds with partial-page reuse: sharing even the next token, the later one
            # waits a step and copies the first one's rows (what page size 1 does by the rule above). Only with no
            # step in flight (can_retract): else the next step is scheduled before this one's rows are recorded.
            nxt_row = (req.namespace, start + copied, tuple(fill[start : start + copied + 1]))
            held = (cache_on and len(nxt[2]) == ps and nxt in first_pages) or (can_retract and nxt_row in first_rows)
            chunk = min(req.num_fill - start - copied, budget, room)
            if held or not self._may_join(req, chunk, chunks):
                if took_slot or head:  # the next step is its own: short prefills cannot keep passing it
                    break
                continue
            head = False
            need = _cdiv(start + copied + chunk, ps) - len(matched_pages)
            self.cache.lock(m.node)
            req.pages = list(matched_pages)
            req.kv_len = start + copied
            reserve = self._reserve(req) - need
            while (
                self._available() < need + reserve + reserved
                and (freed := self._preempt(req, chunks, can_retract)) is not None
            ):
                budget += freed  # priority or fair share may take another's pages
                reserved = sum(self._reserve(r) for r in self.running)
            if self._available() < need + reserve + reserved:
                self.cache.unlock(m.node)
                req.pages, req.kv_len = [], 0
                break
            self._take_in(req, m, hit, need)
            chunks[id(req)] = chunk
            budget -= chunk
            reserved += reserve
            first_pages.add(nxt)
            if self.fair is not None:
                self.fair.charge(req.tenant, chunk)
            if self.partial is not None:
                first_rows.add(nxt_row)
        return budget

    def _beside_pins(self, req: Req) -> bool:
        """Refuse (finish with an error) a request too big for the pool beside the pinned prefixes; it would be
        admitted and retracted forever."""
        need = _cdiv(req.num_fill + max(req.params.max_new_tokens - len(req.output_ids), 0), self.cfg.page_size)
        if need <= self.pool.capacity - self.pins.num_pinned:
            return False
        pinned = self.pins.pinned_pages(self.cache)  # type: ignore[arg-type]  (pins exist: a RadixCache)
        need -= sum(p in pinned for p in self.cache.match_prefix(req.match_ids(), req.namespace).pages)
        room = self.pool.capacity - self.pins.num_pinned
        if need <= room:
            return False
        self.waiting.remove(req)
        self._finish(
            req,
            FinishReason(
                "abort",
                None,
                f"needs {need} KV pages, more than the {room} the pool has "
                "beside pinned prefixes (unpin some: /cache/unpin)",
            ),
        )
        return True

    def _take_in(self, req: Req, m: MatchResult, hit: PartialHit | None, need: int) -> None:
        """Admit a request whose pages were counted: its matched pages (locked) plus `need` fresh ones, the rows of a
        partial page copied into the first of them, the cache accounting of its first admission, a runner slot."""
        copied = hit.num_tokens if hit is not None else 0
        start = len(m.pages) * self.cfg.page_size
        pages = self._alloc(need)
        assert pages is not None, "available pages were counted, so allocation cannot fail"
        req.pages.extend(pages)
        req.node = m.node
        req.num_tree_pages = len(m.pages)
        if hit is not None:
            # Copied at the start of this step, before any KV is written: until the step is processed the rows
            # count as in flight, like computed ones (a failed step never leaves them cached).
            self._copies[id(req)] = (hit.page, pages[0], copied)
            req.kv_inflight += copied
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = start + copied
            self.stats.prompt_tokens += len(req.input_ids)
            self.stats.hit_tokens += start + copied
            self.stats.partial_page_hit_tokens += copied
        req.slot = self._free_slots.pop()
        self.waiting.remove(req)
        self.running.append(req)
        req.status = ReqStatus.RUNNING
