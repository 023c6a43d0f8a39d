"""Cache-aware continuous batching: admit, chunk, decode, retract; then sample and finish what the model produced."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.cache.kv_pool import KVPool
from radixserve.constrained.bitmask import StepMasks
from radixserve.cache.null_cache import NullCache
from radixserve.cache.partial_page import PartialPages
from radixserve.cache.pins import PinTable
from radixserve.cache.radix_cache import RadixCache
from radixserve.forward_batch import ForwardBatch
from radixserve.io import ABORTED, FinishReason
from radixserve.request import Req, ReqStatus, ReqUpdate
from radixserve.speculative.drafter import Drafter
from radixserve.speculative.gate import CostGate
from radixserve.step import Draft, ScheduledBatch
from radixserve.scheduler.fairness import FairShare, preemptible, victim_key
from radixserve.scheduler.admission import Admission
from radixserve.scheduler.output import StepProcessor
from radixserve.scheduler.page_rows import PageRows
from radixserve.scheduler.pages import PageKeeping
from radixserve.scheduler.partial_reuse import PartialReuse


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
    # Copy the rows of a remembered partial page that a prompt matches instead of computing them (cache/partial_page.py)
    enable_partial_page_reuse: bool = True
    lpm_queue_limit: int = 128  # past this many waiting requests, lpm's per-step matching costs more than it saves
    # Admission reserves pages for future decode tokens: remaining max_new_tokens * ratio. The ratio decays while
    # nothing goes wrong (most requests stop early) and jumps back up after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    # Speculative decoding (radixserve/speculative/): at most this many drafted tokens per request and step (0: off),
    # only in steps with at most `speculative_max_batch` decodes (None: any), drafts only of ids below vocab_size.
    speculative_max_tokens: int = 0
    speculative_max_batch: int | None = None
    speculative_measured: bool = False  # draft only while verify steps are measured to pay (speculative/gate.py)
    vocab_size: int = 1 << 31
    max_pinned_share: float = 0.5  # pinned prefixes hold at most this share of the pool
    max_retained_share: float = 0.5  # retained prefixes (cache/retention.py) hold at most this share of the pool
    max_retained_share_per_tenant: float = 0.25  # and each tenant's at most this one
    # Constrained requests: where the grammar admits one continuation, append its tokens without sampling them (they
    # run through the model as an extend chunk, as a prompt would).
    enable_jump_forward: bool = True

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
    hit_tokens: int = 0  # of those, served from the radix cache (partial-page rows included)
    partial_page_hit_tokens: int = 0  # of hit_tokens, rows copied from a partial page (see cache/partial_page.py)
    computed_prefill_tokens: int = 0  # tokens run through the model in prefill chunks (resumes included)
    generation_tokens: int = 0
    forced_tokens: int = 0  # of those, appended by jump-forward (never sampled)
    retractions: int = 0
    finished: int = 0
    failed: int = 0  # requests finished by an internal error (see Scheduler.fail)
    failed_steps: int = 0  # steps that failed as a whole (see Scheduler.fail_batches)
    steps: int = 0


class Scheduler(Admission, StepProcessor, PageKeeping, PartialReuse):
    """Owns the waiting queue and the running set; every page a request holds is accounted for here."""

    def __init__(self, cfg: SchedulerConfig, pool: KVPool, eos_ids: frozenset[int]) -> None:
        self.cfg = cfg
        self.pool = pool
        spec = cfg.speculative_max_tokens > 0
        self.cache: RadixCache | NullCache = NullCache()
        if cfg.enable_radix_cache:
            self.cache = RadixCache(
                pool,
                cfg.page_size,
                index=ContinuationIndex() if spec else None,
                retained_share=cfg.max_retained_share,
                retained_share_per_tenant=cfg.max_retained_share_per_tenant,
            )
        self.drafter = (
            Drafter(
                cfg.speculative_max_tokens,
                cfg.vocab_size,
                getattr(self.cache, "index", None),
                cfg.speculative_max_batch,
                CostGate() if cfg.speculative_measured else None,
            )
            if spec
            else None
        )
        self._drafts: dict[int, Draft] = {}  # id(req) -> its draft, while a step is being scheduled
        reuse = cfg.enable_radix_cache and cfg.enable_partial_page_reuse and cfg.page_size > 1
        self.partial = PartialPages(pool, cfg.page_size) if reuse else None
        # Row copies of the step being scheduled: id(req) -> (source page, destination page, rows)
        self._copies: dict[int, tuple[int, int, int]] = {}
        self.eos_ids = eos_ids
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Finished or aborted while a step of theirs was still in flight: their pages go back once it is processed.
        self.finishing: list[Req] = []
        self.updates: list[ReqUpdate] = []  # for the output stage (see StepProcessor.take_updates)
        self._free_slots = list(range(cfg.max_running_requests - 1, -1, -1))
        self._page_rows = PageRows(cfg.max_running_requests)
        self.stats = SchedulerStats()
        self.fair = FairShare(cfg.chunked_prefill_size) if cfg.fair_share else None
        self.new_token_ratio = cfg.init_new_token_ratio
        self.pins = PinTable(cfg.max_pinned_share)

    # ---- queue management -------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        # Touch the prefix it comes back for: a retained prefix's time (and its place in LRU) runs from the request's
        # arrival, not from when a step first matches it. Steps whose prefill budget running chunks use up admit
        # nobody and match nobody, so an agent turn that came back within its retention could otherwise wait past
        # it in the queue and find the prefix evicted.
        if self.cache.enabled:
            self.cache.match_prefix(req.match_ids(), req.namespace)

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; what it held goes back (its computed full pages stay cached)."""
        self._drop(lambda r: r.rid == rid, ABORTED)

    def _drop(self, which: Callable[[Req], bool], reason: FinishReason) -> None:
        for queue in (self.waiting, self.running):  # (finishing requests are finished already)
            for req in [r for r in queue if which(r)]:
                queue.remove(req)
                self._finish(req, reason)

    def expire(self) -> None:
        """Abort the requests whose timeout has passed (message "timeout"); their pages go back."""
        now = time.perf_counter()
        self._drop(lambda r: r.deadline is not None and r.deadline <= now, FinishReason("abort", None, "timeout"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finishing)

    def _available(self) -> int:
        return self.pool.num_free_pages + self.cache.evictable_pages + self.partial_pages

    # ---- memory (and scheduler/pages.py) -----------------------------------------------------------------------
    def _reserve(self, req: Req) -> int:
        """Pages this request will still want: the rest of its prefill plus an estimate of its decode. Draft slots
        are not counted: drafts take only the pages left after admission, for one step (see _add_drafts)."""
        ps = self.cfg.page_size
        prefill_pages = max(_cdiv(req.num_fill, ps) - len(req.pages), 0)
        decode_left = max(req.params.max_new_tokens - len(req.output_ids), 0)
        return prefill_pages + _cdiv(int(decode_left * self.new_token_ratio), ps)

    def _retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue; its cached prefix makes resuming cheap."""
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)
        req.status = ReqStatus.WAITING
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
        self._copies = {}
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)
        chunks: dict[int, int] = {}  # id(req) -> tokens this step
        self._drafts = {}

        # 1. Decodes (pending == 1) get their page first; under pressure the least advanced request is retracted.
        if not self._schedule_decodes(chunks, can_retract):
            return None  # pages handed out stay with their requests; the next call reuses them

        # 2. Unfinished chunked prefills, then 3. new requests, share the prefill token budget.
        budget = self._continue_prefills(chunks)
        if budget > 0 and self.waiting:
            budget = self._admit(budget, chunks, can_retract)

        if not chunks:
            if self.running and can_retract and not any(r.steps_in_flight for r in self.running):
                # Nothing could run (every prefill is short of pages): free room by retracting, then try again.
                self._retract(self._victim())
                return self.schedule()
            return None
        self._add_drafts(chunks)
        return self._build([r for r in self.running if id(r) in chunks], chunks)

    def _schedule_decodes(self, chunks: dict[int, int], can_retract: bool) -> bool:
        """A page for every decode's next token (retracting the least advanced under pressure); False when a
        retraction is needed but not allowed."""
        ps = self.cfg.page_size
        decodes = [r for r in self.running if r.pending == 1 and self._may_sample(r)]
        for req in sorted(decodes, key=lambda r: -len(r.output_ids)):
            if req not in self.running:
                continue  # retracted as a victim earlier in this loop
            need = _cdiv(req.kv_len + 1, ps) - len(req.pages)
            pages = self._alloc(need)
            while pages is None:
                if not can_retract:
                    return False
                victim = self._victim()
                self._retract(victim)
                if victim is req:
                    break
                pages = self._alloc(need)
            if pages is not None:
                req.pages.extend(pages)
                chunks[id(req)] = 1
        return True

    def _add_drafts(self, chunks: dict[int, int]) -> None:
        """Drafts, last: after every decode has its page and admission has counted its reservations, so a draft
        never costs a retraction or an admission. Its slots come from what is left for this step only: the pages of
        rejected drafts go back when the step is processed, and accepted ones are decode tokens that were reserved."""
        if self.drafter is None:
            return
        decodes = [r for r in self.running if chunks.get(id(r)) == 1 and r.pending == 1 and self._may_sample(r)]
        for req in self.drafter.drafting(decodes, pure=len(decodes) == len(chunks)):
            self._add_draft(req, chunks)

    def _add_draft(self, req: Req, chunks: dict[int, int]) -> None:
        """Extend a decode by a draft: pages for its slots from the free list or the tree, else what the request's
        pages hold already. At most max_new_tokens and the context are ever reached by what it accepts."""
        assert self.drafter is not None
        room = min(req.params.max_new_tokens - len(req.output_ids), self.cfg.context_length - req.num_fill) - 1
        draft = self.drafter.propose(req, room)
        if draft is None:
            return
        ps = self.cfg.page_size
        pages = self._alloc(max(_cdiv(req.kv_len + 1 + len(draft.tokens), ps) - len(req.pages), 0))
        if pages is None:
            draft.tokens = draft.tokens[: len(req.pages) * ps - req.kv_len - 1]
            if not draft.tokens:
                return
            pages = []
        req.pages.extend(pages)
        chunks[id(req)] = 1 + len(draft.tokens)
        self._drafts[id(req)] = draft

    def _may_merge(self, chunk: int, chunks: dict[int, int]) -> bool:
        """Whether a prefill chunk of this size may join a step that already holds `chunks` (only prefills delay each
        other's first tokens; drafts are added after every prefill, see _add_drafts)."""
        limit = self.cfg.prefill_merge_tokens
        return limit is None or chunk <= limit or all(c == 1 for c in chunks.values())

    def _build(self, reqs: list[Req], chunks: dict[int, int]) -> ScheduledBatch:
        """Pack the step and advance each request by it: kv_len, in-flight counts and prompt-logprob progress."""
        token_chunks, prefix_lens, tables, logit_rows = [], [], [], []
        sample_rows: list[int | None] = []
        prompt_rows: list[tuple[int, int, int] | None] = []
        infos, slots, targets = [], [], []
        grammar_rows, matchers = [], []
        placeholders = needs_sync = False
        row = 0
        for req in reqs:
            n = chunks[id(req)]
            draft = self._drafts.get(id(req))
            nd = len(draft.tokens) if draft is not None else 0
            toks = req.fill_ids[req.kv_len : req.kv_len + n - nd]
            if draft is not None:
                toks += draft.tokens
            elif len(toks) < n:  # the last input is the token the step in flight is sampling for this request
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
                    targets.append(
                        (req.input_ids[lo + 1 : hi + 1], req.top_logprobs_num, req.sampling.token_ids_logprob)
                    )
                    req.next_prompt_logprob_pos = hi + 1 if hi + 1 < len(req.input_ids) else -1
            prompt_rows.append(pr)
            if req.kv_len + n - nd == req.num_fill + req.inflight_tokens and self._may_sample(req):
                sample_rows.append(len(logit_rows))
                logit_rows.extend(range(row + n - 1 - nd, row + n))  # a draft's rows verify it
                if req.grammar is not None:
                    grammar_rows.append(len(infos))
                    matchers.append(req.grammar)
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
        page_table = self._page_rows.gather([r.slot for r in reqs], [r.pages for r in reqs])
        fb = ForwardBatch.build(
            token_chunks, prefix_lens, tables, self.cfg.page_size, logit_rows, page_table=page_table
        )
        batch = ScheduledBatch(
            reqs,
            [chunks[id(r)] for r in reqs],
            fb,
            sample_rows,
            prompt_rows,
            infos,
            slots,
            targets,
            has_placeholders=placeholders,
            needs_sync=needs_sync,
            drafts=[self._drafts.get(id(r)) for r in reqs] if self._drafts else [],
            grammar=StepMasks(grammar_rows, matchers) if matchers else None,
        )
        if self._copies:
            self._plan_copies(batch)
        return batch
