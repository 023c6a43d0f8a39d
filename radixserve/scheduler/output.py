"""After the forward: a step's results taken in request by request (prompt logprobs, cache inserts, sampled tokens,
token-level stops), finished requests released, and failures kept to the request that had them. What the caller
sees (text, stop strings, result objects) is built off this thread by the output stage (radixserve/output_stage.py)
from the `ReqUpdate`s collected here; a stop string it finds comes back as `end`, finishing the request like any.

A mixin of `Scheduler` (it works on the scheduler's queues, stats and page bookkeeping)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from radixserve.errors import GrammarFailedError, RequestFailedError
from radixserve.io import INTERNAL_ERROR, STOP_LENGTH, FinishReason
from radixserve.log_bounds import bounded_logger, clip
from radixserve.request import Req, ReqStatus, ReqUpdate
from radixserve.sampling.speculative import DraftRun
from radixserve.step import Draft, ScheduledBatch, StepOutput

if TYPE_CHECKING:
    from collections import deque

    from radixserve.cache.kv_pool import KVPool
    from radixserve.scheduler.scheduler import SchedulerConfig, SchedulerStats
    from radixserve.speculative.drafter import Drafter

log = bounded_logger("radixserve.scheduler")


class StepProcessor:
    cfg: SchedulerConfig
    stats: SchedulerStats
    eos_ids: frozenset[int]
    waiting: deque[Req]
    running: list[Req]
    finishing: list[Req]
    pool: KVPool
    drafter: Drafter | None
    updates: list[ReqUpdate]  # for the output stage, taken by the engine loop after each step (take_updates)
    # and Scheduler's page bookkeeping and queues: _insert, _release, _retract, _drop

    # ---- after the forward ------------------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Take in one executed step: prompt logprobs, cache inserts, sampled tokens, token-level stops; finish.

        A request whose handling raises (its grammar, its cache insert) or whose sampling failed is finished alone
        with an error (`fail`); the others go on."""
        now = time.perf_counter()
        prompt = iter(out.prompt_logprobs)
        k = 0
        drafts = batch.drafts or [None] * len(batch.reqs)
        for i, (req, n, pr, srow, draft) in enumerate(
            zip(batch.reqs, batch.chunks, batch.prompt_rows, batch.sample_rows, drafts)
        ):
            req.steps_in_flight -= 1
            req.kv_inflight -= n + batch.copied_rows(i)
            lps = next(prompt) if pr is not None else None
            sample_k = None
            if srow is not None:
                sample_k, k = k, k + 1
                req.inflight_tokens -= 1
            if req.finished:  # aborted or stopped while this step was in flight: its token is dropped
                continue
            try:
                if sample_k is not None and sample_k in out.failed:
                    raise RuntimeError(f"sampling failed: {out.failed[sample_k]}")
                self._take(req, n, pr, lps, sample_k, out, now, draft)
            except Exception as exc:  # noqa: BLE001 - one request's fault must not reach the others
                self.fail(req, exc)
        for req in batch.reqs:
            try:
                self._settle(req)
            except Exception as exc:  # noqa: BLE001
                self.fail(req, exc)

    def _take(
        self,
        req: Req,
        n: int,
        pr: tuple[int, int, int] | None,
        lps: Any,
        k: int | None,
        out: StepOutput,
        now: float,
        draft: Draft | None = None,
    ) -> None:
        """One request's share of a step: prompt logprobs, its cache insert, its sampled tokens and stop checks.

        Stop strings are the output stage's: tokens past one may still be appended here (a step or two, until its
        `end` arrives); the stage reports none of them, and they cost no more than KV that is cached."""
        if pr is not None:
            pos = pr[2]
            for i, (lp, top) in enumerate(zip(*lps)):
                req.input_token_logprobs.append((lp, req.input_ids[pos + i]))
                req.input_top_logprobs.append(top)
        if (n > 1 and draft is None) or k is None:
            self._insert(req)  # after each prefill chunk
        if k is None:
            return
        run = out.runs.get(k) if draft is not None else None
        if run is None:
            run = DraftRun(
                [out.next_ids[k]],
                None if out.logprobs is None else [out.logprobs[k]],
                None if out.top_logprobs is None else [out.top_logprobs[k]],
            )
        if draft is not None:
            self._drop_rejected(req, draft, run.accepted)
        if req.first_token_time is None:
            req.first_token_time = now
        for i, tok in enumerate(run.ids):
            req.append_token(tok)
            self.stats.generation_tokens += 1
            if req.return_logprob:
                assert run.logprobs is not None
                req.output_token_logprobs.append((run.logprobs[i], tok))
                if (req.top_logprobs_num or req.sampling.token_ids_logprob) and run.top_logprobs is not None:
                    req.output_top_logprobs.append(run.top_logprobs[i])
            if req.grammar is not None and not req.grammar.accept(tok):
                raise req.grammar.failure(tok, len(req.output_ids) - 1)
            self._check_stop(req, tok)
            if req.finished:
                break  # a stop inside an accepted run cuts it there
        jump = self.cfg.enable_jump_forward and not req.return_logprob  # a forced token has no logprob
        if req.grammar is not None and req.grammar.jump_forward and jump and not req.finished:
            self._jump_forward(req)
        if not req.finished:  # the stage decodes as tokens come (stop strings, streams; no burst at the end)
            self.updates.append(ReqUpdate(req, len(req.output_ids)))

    def _drop_rejected(self, req: Req, draft: Draft, accepted: int) -> None:
        """After a verify step: the rejected drafts' KV is not the request's; pages holding only their slots go back
        now (the tree never sees them: only tokens below num_fill are ever cached, and drafts are not appended)."""
        req.kv_len -= len(draft.tokens) - accepted
        keep = max(-(-req.kv_len // self.cfg.page_size), req.num_tree_pages)
        if len(req.pages) > keep:
            self.pool.free(req.pages[keep:])
            del req.pages[keep:]
        if self.drafter is not None:
            self.drafter.record(req, draft, accepted)

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens the grammar forces: the next step runs them through the model as an extend chunk and
        samples after them. (Not for requests that want logprobs: forced tokens have none.)"""
        assert req.grammar is not None
        for tok in req.grammar.forced_tokens():
            if tok in self.eos_ids:
                return  # the end is sampled, so the stop rules apply as to any end
            req.append_token(tok)
            if not req.grammar.accept(tok):
                raise req.grammar.failure(tok, len(req.output_ids) - 1)
            self.stats.generation_tokens += 1
            self.stats.forced_tokens += 1
            self._check_stop(req, tok)
            if req.finished:
                return

    def _settle(self, req: Req) -> None:
        """After a step: release a finished request's pages once no step of it is in flight."""
        if req in self.finishing:
            if req.steps_in_flight == 0:
                self.finishing.remove(req)
                self._release(req)
                req.status = ReqStatus.DONE
            return
        if req.failed:
            return
        if not req.finished and req.params.max_new_tokens == 0 and req.pending == 0:
            req.finish_reason = STOP_LENGTH
        if req.finished:
            self.running.remove(req)
            self._finish(req, req.finish_reason)

    def fail(self, req: Req, exc: BaseException) -> None:
        """Finish one request with an error: log it, free what it holds, tell its caller (never raises). A grammar
        past its limits is the caller's to hear about (a GrammarFailedError, one line in the log); anything else is an
        internal error (the traceback in the log, a RequestFailedError to the caller)."""
        grammar = isinstance(exc, GrammarFailedError)
        if grammar:
            log.warning("request %s ended: %s", clip(req.rid), exc)
        else:
            log.error("request %s failed: %s", clip(req.rid), clip(repr(exc)), exc_info=exc)
        self.stats.failed += 1
        req.finish_reason = FinishReason("error", None, str(exc)) if grammar else INTERNAL_ERROR
        req.status = ReqStatus.DONE
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            if req.steps_in_flight:
                self.finishing.append(req)
                req.status = ReqStatus.FINISHING
            else:
                self._release(req)
        self.updates.append(ReqUpdate(req, len(req.output_ids), error=exc if grammar else RequestFailedError(req.rid)))

    def end(self, req: Req, reason: FinishReason, exc: BaseException | None = None) -> None:
        """The output stage ended a request: a stop string matched (`reason`), or building its output failed (`exc`).
        It is finished here as any finish is (its pages go back); one finished meanwhile is left as it is."""
        if exc is not None and req.finished:  # its final output failed: the pages went back already, count it
            log.error("request %s failed: %s", clip(req.rid), clip(repr(exc)), exc_info=exc)
            self.stats.failed += 1
        elif exc is not None:
            self.fail(req, exc)
        elif not req.finished:
            self._drop(lambda r: r is req, reason)

    def take_updates(self) -> list[ReqUpdate]:
        updates, self.updates = self.updates, []
        return updates

    def fail_batches(self, batches: list[ScheduledBatch], exc: BaseException) -> None:
        """Steps failed with no request to blame: undo their effect on their requests, fail the newest request
        (the likeliest culprit: the others ran before it came), and send the rest back to the queue to run again
        (their outputs so far are kept; their KV of the failed steps was never cached)."""
        self.stats.failed_steps += 1
        reqs: dict[int, Req] = {}
        for batch in batches:
            for i, (req, n, srow) in enumerate(zip(batch.reqs, batch.chunks, batch.sample_rows)):
                c = batch.copied_rows(i)  # a failed step's copies are undone with its tokens
                req.steps_in_flight -= 1
                req.kv_inflight -= n + c
                req.kv_len -= n + c
                if srow is not None:
                    req.inflight_tokens -= 1
                reqs[id(req)] = req
        live = [r for r in reqs.values() if not r.finished]
        for req in reqs.values():
            if req in self.finishing:
                self._settle(req)
        if live:
            self.fail(max(live, key=lambda r: r.created), exc)
        for req in live:
            if not req.finished and req in self.running:
                self._retract(req)

    def _check_stop(self, req: Req, tok: int) -> None:
        """Token-level ends only (a stop token, the length); stop strings are the output stage's."""
        p = req.params
        early = len(req.output_ids) < p.min_new_tokens  # SGLang: no stop counts before min_new_tokens are out
        if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)):
            req.finish_reason = FinishReason("stop", tok)
        elif len(req.output_ids) >= p.max_new_tokens or req.num_fill >= self.cfg.context_length:
            req.finish_reason = STOP_LENGTH

    def _finish(self, req: Req, reason: FinishReason | None) -> None:
        """Hand the final update over; the pages go back now, or when the request's last step in flight is done."""
        req.finish_reason = reason
        if req.steps_in_flight:
            self.finishing.append(req)
            req.status = ReqStatus.FINISHING
        else:
            self._release(req)
            req.status = ReqStatus.DONE
        self.stats.finished += 1
        self.updates.append(ReqUpdate(req, len(req.output_ids), reason))
