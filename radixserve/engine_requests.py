"""Submitting requests and waiting for their outputs: places in the queue (all of a call's requests or none), a
request's output side (radixserve/output_stage.py, whose thread calls `emit`), and the caller's event loop, to which
each output is posted. A mixin of `Engine`."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from radixserve.errors import ParamError, QueueFullError
from radixserve.inputs import RequestBuilder, RequestSpec
from radixserve.io import GenerateOutput, StreamChunk
from radixserve.request import Req

if TYPE_CHECKING:
    from radixserve.engine_loop import EngineLoop
    from radixserve.output_stage import OutputStage
    from radixserve.timeline import Tracker


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], item: Any) -> None:
    """Hand a result to the caller's event loop from the output stage's thread."""
    try:
        loop.call_soon_threadsafe(fn, item)
    except RuntimeError:
        pass  # that loop has closed: its caller left (its request was aborted), so nobody waits for this


class RequestPath:
    loop: EngineLoop
    outputs: OutputStage
    inputs: RequestBuilder
    tracker: Tracker
    max_queued_requests: int | None
    _inflight: int  # requests submitted and not finished (the queue limit counts those not yet running)
    _inflight_lock: threading.Lock

    def abort(self, rid: str) -> None:
        self.loop.inbox.put(("abort", rid))

    def _reserve(self, count: int, field: str) -> None:
        """Count `count` requests in flight, all or none: QueueFullError when the waiting queue cannot take them all
        now, ParamError (naming `field`) when it never could."""
        self.loop.check_alive()
        limit = self.max_queued_requests
        if limit is not None and count > limit:
            raise ParamError(
                field, f"{count} requests at once can never fit the queue of {limit} (max_queued_requests)"
            )
        with self._inflight_lock:
            waiting = self._inflight - self.loop.running_snapshot
            if limit is not None and waiting + count > limit:
                raise QueueFullError(f"{waiting} requests are already waiting (max_queued_requests {limit})")
            self._inflight += count

    def _unreserve(self, count: int) -> None:
        with self._inflight_lock:
            self._inflight -= count

    def _submit(self, spec: RequestSpec, emit: Callable[[Any], None], stream: bool) -> Req:
        """Queue one request the caller has reserved a place for (`_reserve`): `_submit_all` of one."""
        return self._submit_all([spec], [emit], stream)[0]

    def _submit_all(self, specs: list[RequestSpec], emits: list[Callable[[Any], None]], stream: bool) -> list[Req]:
        """Queue requests the caller has reserved places for (`_reserve`), all in one message to the loop; each place
        is given back when its request finishes, or here, all of them, if building any request fails (then none is
        queued).

        One message, so the loop thread never wakes between two of a call's requests: a batch reaches the scheduler
        whole and the steps it gets do not depend on thread timing. Without deterministic mode a prompt's bits depend
        on what shares its steps (its prefill's attention is padded to the longest prompt beside it:
        radixserve/model/deterministic.py), so a batch queued one request at a time gave the same call different
        logprobs from run to run (tests/test_cpu_stack.py, RESULTS.md issue 38 session 22)."""
        try:
            reqs = [self._open_req(spec, emit, stream) for spec, emit in zip(specs, emits, strict=True)]
        except BaseException:
            self._unreserve(len(specs))
            raise
        self.loop.inbox.put(("add", reqs))
        return reqs

    def _open_req(self, spec: RequestSpec, emit: Callable[[Any], None], stream: bool) -> Req:
        def emit_and_count(item: GenerateOutput | BaseException) -> None:
            if isinstance(item, BaseException) or item.finished:
                with self._inflight_lock:
                    self._inflight -= 1
                self.tracker.close(req, item)
            emit(item)

        req = self.inputs.make_req(spec, stream)
        self.outputs.open(req, emit_and_count)
        req.timeline = self.tracker.open(req)
        return req

    async def _stream(self, spec: RequestSpec) -> AsyncIterator[StreamChunk]:
        """One request's chunks; it is queued when the caller first asks for a chunk."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        self._reserve(1, "prompt")
        req = self._submit(spec, lambda c: _post(loop, chunks.put_nowait, c), stream=True)
        async for chunk in self._chunks(req, chunks):
            yield chunk

    def _stream_all(self, specs: list[RequestSpec]) -> list[AsyncIterator[StreamChunk]]:
        """Queue the requests now, together (`_submit_all`: all or none), and return their chunk streams. The caller
        must read or abort each: a stream never read does not abort its request."""
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in specs]
        self._reserve(len(specs), "prompt")
        emits = [lambda c, q=q: _post(loop, q.put_nowait, c) for q in queues]
        reqs = self._submit_all(specs, emits, stream=True)
        return [self._chunks(req, q) for req, q in zip(reqs, queues)]

    async def _chunks(self, req: Req, chunks: asyncio.Queue[Any]) -> AsyncIterator[StreamChunk]:
        done = False
        try:
            while not done:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                done = chunk.finished
                yield chunk
        finally:
            if not done:  # the caller left early (break, aclose, cancellation, disconnect)
                self.abort(req.rid)

    async def _run_all(self, specs: list[RequestSpec]) -> list[GenerateOutput]:
        """Submit requests that report only their final results (`_submit_all`) and wait for them all; the first
        failure aborts the others and is raised, and cancelling aborts them all."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[Any]] = [loop.create_future() for _ in specs]

        def settler(fut: asyncio.Future[Any]) -> Callable[[Any], None]:
            def settle(item: Any) -> None:
                if not fut.done():
                    fut.set_result(item)

            return lambda item: _post(loop, settle, item)

        reqs = self._submit_all(specs, [settler(f) for f in futs], stream=False)
        pending: set[asyncio.Future[Any]] = set(futs)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = next((f.result() for f in done if isinstance(f.result(), BaseException)), None)
                if failed is not None:
                    raise failed
        except BaseException:
            for req, fut in zip(reqs, futs):
                if not fut.done():
                    self.abort(req.rid)
            raise
        return [f.result() for f in futs]

    async def _collect(self, specs: list[RequestSpec]) -> list[GenerateOutput]:
        # n > 1: prefill each prompt once (a zero-token request), so the n samples all hit its pages in the tree.
        multi = [
            replace(s, rid=uuid.uuid4().hex, params=s.params.replace(max_new_tokens=0, n=1), return_logprob=False)
            for s in specs
            if s.params.n > 1
        ]
        expanded: list[RequestSpec] = []
        for s in specs:
            for i in range(s.params.n):
                seed = s.params.seed + i if s.params.seed is not None else None
                rid = s.rid if s.params.n == 1 else f"{s.rid}-{i}"
                expanded.append(replace(s, rid=rid, params=s.params.replace(n=1, seed=seed)))
        # The whole batch is admitted or refused: never some members running while the caller got a 429.
        self._reserve(len(multi) + len(expanded), "n" if any(s.params.n > 1 for s in specs) else "prompt")
        unsent = len(expanded)
        try:
            if multi:
                await self._run_all(multi)
            unsent = 0
            return await self._run_all(expanded)
        finally:
            self._unreserve(unsent)  # the samples never submitted (their prefill failed or was cancelled)
