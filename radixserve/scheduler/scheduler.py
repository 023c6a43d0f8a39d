"""Cache-aware continuous batching: admit, chunk, decode, retract; then sample and finish what the model produced."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.null_cache import NullCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.forward_batch import ForwardBatch
from radixserve.request import Req
from radixserve.step import ScheduledBatch
from radixserve.scheduler.fairness import FairShare, by_priority_only, preemptible, victim_key
from radixserve.scheduler.output import OutputProcessor


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SchedulerConfig:
    page_size: int
    context_length: int
    chunked_prefill_size: int = 512  # prefill tokens per step, over all requests
    # A prefill chunk longer than this joins a step only if the step holds no other prefill work. Where prefill is
    # compute-bound (CPUs), a step costs a fixed part plus a part per token, so merging n more tokens delays every
    # first token in the step by n tokens' time while saving the merged request only the fixed part: run them one
    # after another. None: no limit (GPUs, where a step's token count barely changes its time).
    prefill_merge_tokens: int | None = None
    max_running_requests: int = 64
    schedule_policy: str = "lpm"  # "lpm" (longest cached prefix first) or "fcfs"
    enable_radix_cache: bool = True
    fair_share: bool = True  # interleave tenants' admissions by prefill tokens served (see fairness.py)
    lpm_queue_limit: int = 128  # past this many waiting requests, lpm's per-step matching costs more than it saves
    # Admission reserves pages for future decode tokens: remaining max_new_tokens * ratio. The ratio decays while
    # nothing goes wrong (most requests stop early) and jumps back up after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if self.prefill_merge_tokens is not None and self.prefill_merge_tokens < 1:
            raise ValueError("prefill_merge_tokens must be >= 1 or None")


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    hit_tokens: int = 0  # of those, served from the radix cache
    computed_prefill_tokens: int = 0  # tokens run through the model in prefill chunks (resumes included)
    generation_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    failed: int = 0  # requests finished by an internal error (see Scheduler.fail)
    failed_steps: int = 0  # steps that failed as a whole (see Scheduler.fail_batches)
    steps: int = 0


class Scheduler(OutputProcessor):
    """Owns the waiting queue and the running set; every page a request holds is accounted for here."""

    def __init__(self, cfg: SchedulerConfig, pool: KVPool, eos_ids: frozenset[int]) -> None:
        self.cfg = cfg
        self.pool = pool
        self.cache: RadixCache | NullCache = RadixCache(pool, cfg.page_size) if cfg.enable_radix_cache else NullCache()
        self.eos_ids = eos_ids
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Finished or aborted while a step of theirs was still in flight: their pages go back once it is processed.
        self.finishing: list[Req] = []
        self._free_slots = list(range(cfg.max_running_requests - 1, -1, -1))
        self.stats = SchedulerStats()
        self.fair = FairShare() if cfg.fair_share else None
        self.new_token_ratio = cfg.init_new_token_ratio

    # ---- queue management -------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; what it held goes back (its computed full pages stay cached)."""
        self._drop(lambda r: r.rid == rid, "aborted")

    def _drop(self, which: Callable[[Req], bool], message: str) -> None:
        for queue in (self.waiting, self.running):  # (finishing requests are finished already)
            for req in [r for r in queue if which(r)]:
                queue.remove(req)
                self._finish(req, {"type": "abort", "matched": None, "message": message})

    def expire(self) -> None:
        """Abort the requests whose timeout has passed (message "timeout"); their pages go back."""
        now = time.perf_counter()
        self._drop(lambda r: r.deadline is not None and r.deadline <= now, "timeout")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finishing)

    # ---- memory -----------------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int] | None:
        """n pool pages, evicting unlocked radix-tree leaves if the free list is short."""
        if n == 0:
            return []
        pages = self.pool.alloc(n)
        if pages is None:
            self.cache.evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(n)
        return pages

    def _available(self) -> int:
        return self.pool.num_free_pages + self.cache.evictable_pages

    def _reserve(self, req: Req) -> int:
        """Pages this request will still want: the rest of its prefill plus an estimate of its decode."""
        ps = self.cfg.page_size
        prefill_pages = max(_cdiv(req.num_fill, ps) - len(req.pages), 0)
        decode_left = max(req.params.max_new_tokens - len(req.output_ids), 0)
        return prefill_pages + _cdiv(int(decode_left * self.new_token_ratio), ps)

    def _insert(self, req: Req) -> None:
        """Give the request's computed full pages to the tree and point its page table at the tree's copies."""
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
        private = req.pages[req.num_tree_pages :]
        self.pool.free(private)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.pages, req.node, req.num_tree_pages, req.kv_len = [], None, 0, 0
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def _retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue; its cached prefix makes resuming cheap."""
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, self.cfg.init_new_token_ratio) + 0.1)

    def _victim(self) -> Req:
        """The lowest-priority running request, the least advanced (fewest generated tokens, newest) among those."""
        return min(self.running, key=victim_key)

    def _preempt(self, req: Req, chunks: dict[int, int], can_retract: bool) -> int | None:
        """Retract a running request to make room for `req` (one of lower priority, or one of a tenant holding far
        more running requests: fairness.preemptible); returns the prefill tokens the victim had in this step (0 for
        a decode), or None if there is none to retract."""
        victims = preemptible(self.running, req, self.fair is not None) if can_retract else []
        if not victims:
            return None
        victim = min(victims, key=victim_key)
        chunk = chunks.pop(id(victim), 0)
        self._retract(victim)
        return chunk if chunk > 1 else 0

    # ---- scheduling -------------------------------------------------------------------------------------------
    def _may_sample(self, req: Req) -> bool:
        """False once the tokens sampled (seen or in flight) reach a length limit: the step in flight ends it."""
        made = len(req.output_ids) + req.inflight_tokens
        return made < req.params.max_new_tokens and req.num_fill + req.inflight_tokens < self.cfg.context_length

    def schedule(self, can_retract: bool = True) -> ScheduledBatch | None:
        """Pick this step's work: every decode, unfinished prefill chunks, then new requests under the budget.

        With `can_retract=False` (a step is in flight, whose requests must keep their pages), a step that would need
        a retraction returns None instead: the caller processes the step in flight and asks again."""
        self.stats.steps += 1
        self.expire()
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)
        ps = self.cfg.page_size
        chunks: dict[int, int] = {}  # id(req) -> tokens this step

        # 1. Decodes (pending == 1) get their page first; under pressure the least advanced request is retracted.
        decodes = [r for r in self.running if r.pending == 1 and self._may_sample(r)]
        for req in sorted(decodes, key=lambda r: -len(r.output_ids)):
            if req not in self.running:
                continue  # retracted as a victim earlier in this loop
            need = _cdiv(req.kv_len + 1, ps) - len(req.pages)
            pages = self._alloc(need)
            while pages is None:
                if not can_retract:
                    return None  # pages handed out above stay with their requests; the next call reuses them
                victim = self._victim()
                self._retract(victim)
                if victim is req:
                    break
                pages = self._alloc(need)
            if pages is not None:
                req.pages.extend(pages)
                chunks[id(req)] = 1

        # 2. Unfinished chunked prefills, then 3. new requests, share the prefill token budget.
        budget = self.cfg.chunked_prefill_size
        for req in [r for r in self.running if r.pending > 1]:
            if budget <= 0:
                break
            chunk = min(req.pending, budget)
            if not self._may_merge(chunk, chunks):
                continue
            pages = self._alloc(_cdiv(req.kv_len + chunk, ps) - len(req.pages))
            if pages is None:
                continue
            req.pages.extend(pages)
            chunks[id(req)] = chunk
            budget -= chunk
            if self.fair is not None:
                self.fair.charge(req.tenant, chunk)

        if budget > 0 and self.waiting:
            budget = self._admit(budget, chunks, can_retract)

        if not chunks:
            if self.running and can_retract and not any(r.steps_in_flight for r in self.running):
                # Nothing could run (every prefill is short of pages): free room by retracting, then try again.
                self._retract(self._victim())
                return self.schedule()
            return None
        return self._build([r for r in self.running if id(r) in chunks], chunks)

    def _may_merge(self, chunk: int, chunks: dict[int, int]) -> bool:
        """Whether a prefill chunk of this size may join a step that already holds `chunks`."""
        limit = self.cfg.prefill_merge_tokens
        return limit is None or chunk <= limit or all(c == 1 for c in chunks.values())

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

    def _admit(self, budget: int, chunks: dict[int, int], can_retract: bool = True) -> int:
        ps = self.cfg.page_size
        cache_on = self.cache.enabled
        reserved = sum(self._reserve(r) for r in self.running)
        first_pages: set[tuple[str, int, tuple[int, ...]]] = set()
        stuck: set[str] = set()  # tenants whose candidates find the slots full and can retract nobody
        head = True  # the first candidate that could run: never passed over by later ones
        for req in self._order(list(self.waiting)):
            if budget <= 0:
                break
            if self._slots_full() and req.tenant in stuck:
                continue  # its tenant's earlier (no lower priority) candidate could retract nobody: nor can it
            took_slot = False
            while self._slots_full() and (freed := self._preempt(req, chunks, can_retract)) is not None:
                budget, took_slot = budget + freed, True  # priority or fair share took another's slot
            if self._slots_full():
                stuck.add(req.tenant)  # another tenant's candidate may still retract (fair share, priority)
                continue
            # Re-match: an eviction while admitting an earlier candidate may have shortened this match.
            m = self.cache.match_prefix(req.match_ids(), req.namespace)
            matched_pages = m.pages
            start = len(matched_pages) * ps
            # Two requests admitted together would both compute a prefix they share; hold the later one back a
            # step so it finds the first one's pages in the tree instead.
            fill = req.fill_ids
            nxt = (req.namespace, start, tuple(fill[start : start + ps]))
            chunk = min(req.num_fill - start, budget)
            if (cache_on and len(nxt[2]) == ps and nxt in first_pages) or not self._may_merge(chunk, chunks):
                if took_slot or head:  # the next step is its own: short prefills cannot keep passing it
                    break
                continue
            head = False
            need = _cdiv(start + chunk, ps) - len(matched_pages)
            self.cache.lock(m.node)
            req.pages = list(matched_pages)
            req.kv_len = start
            reserve = self._reserve(req) - need
            while self._available() < need + reserve + reserved and (freed := self._preempt(req, chunks,
                                                                                             can_retract)) is not None:
                budget += freed  # priority or fair share may take another's pages
                reserved = sum(self._reserve(r) for r in self.running)
            if self._available() < need + reserve + reserved:
                self.cache.unlock(m.node)
                req.pages, req.kv_len = [], 0
                break
            pages = self._alloc(need)
            assert pages is not None, "available pages were counted, so allocation cannot fail"
            req.pages.extend(pages)
            req.node = m.node
            req.num_tree_pages = len(matched_pages)
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = start
                self.stats.prompt_tokens += len(req.input_ids)
                self.stats.hit_tokens += start
            req.slot = self._free_slots.pop()
            self.waiting.remove(req)
            self.running.append(req)
            chunks[id(req)] = chunk
            budget -= chunk
            reserved += reserve
            first_pages.add(nxt)
            if self.fair is not None:
                self.fair.charge(req.tenant, chunk)
        return budget

    def _build(self, reqs: list[Req], chunks: dict[int, int]) -> ScheduledBatch:
        """Pack the step and advance each request by it: kv_len, in-flight counts and prompt-logprob progress."""
        token_chunks, prefix_lens, tables, logit_rows = [], [], [], []
        sample_rows: list[int | None] = []
        prompt_rows: list[tuple[int, int, int] | None] = []
        infos, slots, targets = [], [], []
        placeholders = needs_sync = False
        row = 0
        for req in reqs:
            n = chunks[id(req)]
            toks = req.fill_ids[req.kv_len : req.kv_len + n]
            if len(toks) < n:  # the last input is the token the step in flight is sampling for this request
                toks.append(-(req.slot + 1))
                placeholders = True
            token_chunks.append(toks)
            prefix_lens.append(req.kv_len)
            tables.append(req.pages)
            # Prompt logprobs: row at position q scores prompt token q+1.
            pr = None
            if req.next_prompt_logprob_pos >= 0:
                lo = max(req.kv_len, req.next_prompt_logprob_pos - 1)
                hi = min(req.kv_len + n, len(req.input_ids) - 1)
                if hi > lo:
                    pr = (len(logit_rows), hi - lo, lo + 1)
                    logit_rows.extend(range(row + lo - req.kv_len, row + hi - req.kv_len))
                    targets.append((req.input_ids[lo + 1 : hi + 1], req.top_logprobs_num))
                    req.next_prompt_logprob_pos = hi + 1 if hi + 1 < len(req.input_ids) else -1
            prompt_rows.append(pr)
            if req.kv_len + n == req.num_fill + req.inflight_tokens and self._may_sample(req):
                sample_rows.append(len(logit_rows))
                logit_rows.append(row + n - 1)
                infos.append(req.sampling)
                slots.append(req.slot)
                p = req.params
                needs_sync |= p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
                req.inflight_tokens += 1
            else:
                sample_rows.append(None)
            self.stats.computed_prefill_tokens += max(min(req.kv_len + n, len(req.input_ids)) - req.kv_len, 0)
            req.kv_len += n
            req.kv_inflight += n
            req.steps_in_flight += 1
            row += n
        # Built on the CPU: the loop thread never touches the device (the runner copies the batch over, see
        # ForwardBatch.to), so scheduling step N+1 never waits behind step N's kernels.
        fb = ForwardBatch.build(token_chunks, prefix_lens, tables, self.cfg.page_size, logit_rows)
        return ScheduledBatch(
            reqs, [chunks[id(r)] for r in reqs], fb, sample_rows, prompt_rows, infos, slots, targets,
            has_placeholders=placeholders, needs_sync=needs_sync,
        )

    # ---- maintenance ------------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.cache.reset()
        return True

    def check_invariants(self) -> None:
        """Every page is free, in the tree, or private to exactly one running request; lock counts add up."""
        self.cache.check_invariants()
        holders = self.running + self.finishing
        private = [p for r in holders for p in r.pages[r.num_tree_pages :]]
        assert len(private) == len(set(private)), "a private page is held by two requests"
        total = self.pool.num_free_pages + self.cache.total_pages + len(private)
        assert total == self.pool.capacity, (
            f"page leak: free {self.pool.num_free_pages} + tree {self.cache.total_pages} + private {len(private)} "
            f"!= capacity {self.pool.capacity}"
        )
        for r in self.waiting:
            assert not r.pages and r.node is None, f"waiting request {r.rid} holds pages"
        if not holders:
            assert self.cache.protected_pages == 0, "no request runs, yet tree pages are locked"
            assert len(self._free_slots) == self.cfg.max_running_requests, "a runner slot leaked"
