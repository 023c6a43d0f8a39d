"""The output stage: a thread of its own that turns the engine loop's `ReqUpdate`s into what callers receive, so the
loop never detokenizes (as vLLM v1's OutputProcessor does beside its engine core).

Per request it detokenizes the new ids one by one (UTF-8 safe, radixserve/detokenizer.py), checks the stop strings,
holds back streamed text that may yet be the start of one, and builds `GenerateOutput` / `StreamChunk`s. The loop
ends requests on token-level conditions only; when a stop string matches here, the stage reports the ids up to the
token that completed it, and tells the loop (`("end", req, reason, None)` in its inbox) to finish the request as any
finish does. It tells the loop before the caller hears of the end, so a call the caller makes next (through the
same inbox) finds the request finished. A fault while building one request's output fails that request alone."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.errors import RequestFailedError
from radixserve.io import INTERNAL_ERROR, FinishReason, GenerateOutput, OutputMeta, StreamChunk
from radixserve.request import Req, ReqUpdate
from radixserve.tokenizer import Tokenizer

log = logging.getLogger("radixserve.output")


class ReqOutput:
    """One request's side of the stage (only the stage's thread touches it after `open`)."""

    __slots__ = ("detok", "emit", "taken", "sent_ids", "sent_text", "done")

    def __init__(self, detok: IncrementalDetokenizer, emit: Callable[[GenerateOutput | BaseException], None]) -> None:
        self.detok = detok
        self.emit = emit  # hands an output (or the exception that ended the request) to its caller
        self.taken = 0  # output ids taken in (decoded, or a stop token, which is not)
        self.sent_ids = 0  # output ids already sent to a streaming caller (also its output logprobs)
        self.sent_text = 0  # characters of detok.text already sent
        self.done = False  # the final output (or an error) was sent: later updates of the request are dropped


class OutputStage:
    """`put` takes a step's updates from the loop thread; the stage's thread handles them in order."""

    def __init__(self, tokenizer: Tokenizer, inbox: queue.Queue[tuple[Any, ...]]) -> None:
        self.tokenizer = tokenizer
        self.inbox = inbox  # the engine loop's: where an end found here goes
        self._queue: queue.SimpleQueue[list[ReqUpdate] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="radixserve-output", daemon=True)
        self.thread.start()

    def open(self, req: Req, emit: Callable[[GenerateOutput | BaseException], None]) -> None:
        """Give a request its output side before it is queued (its stop strings, its detokenizer's context)."""
        p = req.params
        detok = IncrementalDetokenizer(
            self.tokenizer, req.input_ids, p.skip_special_tokens, p.stop, p.stop_regex, p.no_stop_trim
        )
        req.output = ReqOutput(detok, emit)

    def put(self, updates: list[ReqUpdate]) -> None:
        self._queue.put(updates)

    def stop(self) -> None:
        """Handle what was put so far, then end the thread."""
        self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _run(self) -> None:
        while (updates := self._queue.get()) is not None:
            for u in updates:
                try:
                    self.take(u)
                except Exception as exc:  # noqa: BLE001 - one request's fault must not reach the others
                    self._fail(u.req, exc)

    def take(self, u: ReqUpdate) -> None:
        """One update: decode its new ids, stop at a stop string, send a chunk or the final output."""
        req = u.req
        out: ReqOutput = req.output
        if out.done:
            return
        if u.error is not None:
            out.done = True
            out.emit(u.error)
            return
        finish = u.finish
        # A stop token (EOS or stop_token_ids) ends the ids but is not text.
        stop_token = finish is not None and finish.type == "stop" and isinstance(finish.matched, int)
        # no_stop_trim keeps it, as SGLang (special tokens still drop out with skip_special_tokens)
        decode_to = u.num_ids - 1 if stop_token and not req.params.no_stop_trim else u.num_ids
        ids = req.output_ids
        min_new = req.params.min_new_tokens
        while out.taken < decode_to:
            out.detok.armed = out.taken + 1 >= min_new  # no stop string counts before min_new_tokens are out
            _, matched = out.detok.step([ids[out.taken]])
            out.taken += 1
            if matched is not None:
                if finish is None:  # the loop has not ended it: it must, before the caller hears of the end
                    self.inbox.put(("end", req, FinishReason("stop", matched), None))
                self._send(req, out, FinishReason("stop", matched))
                return
        out.taken = u.num_ids
        if finish is not None:
            out.detok.flush()  # text held back for a possible stop string is the caller's after all
            self._send(req, out, finish)
        elif req.stream and out.taken - out.sent_ids >= (req.params.stream_interval or 1):
            self._send(req, out, None)

    def _fail(self, req: Req, exc: Exception) -> None:
        """Building this request's output failed: the loop finishes it with an error (first), its caller hears so."""
        out: ReqOutput = req.output
        if out.done:
            return
        self.inbox.put(("end", req, INTERNAL_ERROR, exc))
        out.done = True
        out.emit(RequestFailedError(req.rid))

    def _send(self, req: Req, out: ReqOutput, finish: FinishReason | None) -> None:
        """A result: the whole result, or for a stream a chunk of only what is new since the last chunk."""
        n = out.taken
        text = out.detok.text
        lo = out.sent_ids if req.stream else 0
        meta = OutputMeta(
            id=req.rid,
            prompt_tokens=len(req.input_ids),
            completion_tokens=n,
            cached_tokens=req.cached_tokens,
            finish_reason=finish,
            ttft=(req.first_token_time - req.created) if req.first_token_time else None,
            e2e_latency=time.perf_counter() - req.created,
        )
        if req.return_logprob:
            meta.output_token_logprobs = req.output_token_logprobs[lo:n]
            meta.output_token_logprobs_length = n
            meta.output_top_logprobs, meta.output_token_ids_logprobs = _split(req, req.output_top_logprobs[lo:n])
            if req.logprob_start_len >= 0 and lo == 0:  # a stream's prompt logprobs come with its first chunk
                meta.input_token_logprobs = req.input_token_logprobs
                meta.input_top_logprobs, meta.input_token_ids_logprobs = _split(req, req.input_top_logprobs)
        if req.stream:
            result: GenerateOutput = StreamChunk(text[out.sent_text :], req.output_ids[lo:n], meta)
            out.sent_ids, out.sent_text = n, len(text)
        else:
            result = GenerateOutput(text, req.output_ids[:n], meta)
        out.done = finish is not None
        out.emit(result)


def _split(req: Req, tops: list[Any]) -> tuple[list[Any] | None, list[Any] | None]:
    """A request's per-position top lists (its top_logprobs_num best, then its token_ids_logprob ones, or None where
    a position has none) as (top logprobs, token_ids_logprob logprobs), each None where not asked for."""
    k, wanted = req.top_logprobs_num, bool(req.sampling.token_ids_logprob)
    if not wanted:
        return (tops if k else None), None
    best = [t if t is None else t[:k] for t in tops] if k else None
    return best, [t if t is None else t[k:] for t in tops]
