"""Plumbing every endpoint shares: server state, body limits, tenants, admission, engine errors and calls, SSE.

Engine calls run as tasks raced against the client's disconnect: a client that goes away while its request waits in the
queue or decodes gets the request aborted (its pages freed), whether it streams or not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.constrained.grammar import built
from radixserve.errors import ParamError, QueueFullError, RequestFailedError
from radixserve.io import FinishReason, GenerateOutput, GenerateRequest, StreamChunk
from radixserve.server.chat_prompt import ChatPromptBuilder
from radixserve.server.errors import ApiError, bad_request
from radixserve.server.live_requests import LiveRequests
from radixserve.server.metrics import ServerMetrics
from radixserve.server.auth import principal_of
from radixserve.server.protocol import decode_body
from radixserve.server.quotas import charge
from radixserve.server.tenants import KeyRing

if TYPE_CHECKING:
    from radixserve.engine import Engine
    from radixserve.server.agent_retention import ToolGaps

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ServerState:
    """What the handlers share, kept on app.state.server (one per app, nothing global)."""

    engine: Engine
    model_name: str
    model_path: str
    context_length: int
    vocab_size: int
    pool_tokens: int  # KV pool capacity in tokens: a prompt plus its answer must fit
    created: int
    max_queued_requests: int | None
    max_body_bytes: int
    metrics: ServerMetrics
    prompts: ChatPromptBuilder
    keys: KeyRing | None = None  # None: no keys, every request is the operator's (tenants.OPEN)
    draining: bool = False  # set on SIGTERM: admit nothing new, let running requests finish
    incremental_streaming_output: bool = False  # a /generate stream's events hold only what is new (else all so far)
    reasoning_parser: str = "auto"  # --reasoning-parser (reasoning.REASONING_PARSERS)
    live: LiveRequests = field(default_factory=LiveRequests)  # running /generate requests, for /abort_request
    tool_gaps: ToolGaps | None = None  # agent retention (agent_retention.py); None: --no-agent-retention
    json: msgspec.json.Encoder = field(default_factory=msgspec.json.Encoder)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request, type_: type[T]) -> T:
    """Read the body under the size limit (413 past it) and decode it into `type_` (400 naming the bad field)."""
    limit = server_state(request).max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="request_too_large"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return decode_body(b"".join(chunks), type_)


def cache_salt(request: Request, requested: str | None) -> str:
    """The request's cache namespace: its API key's tenant (set by the auth middleware) and its own cache_salt."""
    tenant = request.scope.get("state", {}).get("tenant", "")
    if not tenant:
        return requested or ""
    return f"{tenant}|{requested}" if requested else tenant


def scheduling(request: Request, priority: int, timeout: float | None) -> dict[str, Any]:
    """The engine call's scheduling arguments: priority, timeout, and the tenant whose fair share it uses (the
    key's namespace; without keys, each cache_salt is its own)."""
    who = principal_of(request)
    return {"priority": priority, "timeout": timeout, "tenant": who.namespace or None}


def aborted(fin: FinishReason) -> ApiError:
    """The error for a request the engine aborted: 504 if its own timeout ran out, else 503."""
    if fin.message == "timeout":
        return ApiError(
            504,
            "request timed out (its `timeout` ran out); it was stopped and its pages freed",
            type="timeout_error",
            code="timeout",
        )
    return ApiError(503, f"request aborted: {fin.message or 'aborted'}", type="service_unavailable")


async def admit(state: ServerState, count: int = 1) -> None:
    """Refuse new work while draining (503) or when the waiting queue is full (429 with Retry-After).

    An engine built with a limit at least as strict enforces it itself (QueueFullError, no round trip to its loop);
    otherwise the server asks the engine how many requests wait."""
    if state.draining:
        raise ApiError(503, "server is shutting down", type="service_unavailable", headers={"Retry-After": "5"})
    limit = state.max_queued_requests
    own = state.engine.max_queued_requests
    if limit is not None and count > limit:  # a 429 would invite a retry that can never succeed
        raise bad_request(
            f"{count} requests at once can never fit the queue of {limit} (--max-queued-requests)",
            param="n",
            code="too_many_requests_in_one_call",
        )
    if limit is None or (own is not None and own <= limit):
        return
    waiting = (await asyncio.to_thread(state.engine.metrics))["num_waiting"]
    if waiting + count > limit:
        raise queue_full(f"{waiting} requests are already waiting (limit {limit})")


def queue_full(why: str) -> ApiError:
    return ApiError(
        429,
        f"server busy: {why}; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": "1"},
    )


@contextlib.contextmanager
def engine_errors(default_param: str | None, renames: dict[str, str] | None = None) -> Iterator[None]:
    """Map engine exceptions to HTTP: ParamError -> 400 naming the field as the client sent it (`renames` maps engine
    names such as max_new_tokens to the route's; "prompt" means the route's prompt field), QueueFullError -> 429,
    a request that failed inside the engine -> 500 naming its id, a stopped engine -> 503."""
    try:
        yield
    except QueueFullError as exc:
        raise queue_full(str(exc)) from None
    except ParamError as exc:
        param = default_param if exc.field == "prompt" else (renames or {}).get(exc.field, exc.field)
        raise bad_request(exc.message, param=param, code=exc.code) from None
    except ValueError as exc:
        raise bad_request(str(exc), param=default_param) from None
    except RequestFailedError as exc:
        raise ApiError(
            500,
            f"internal error while serving request {exc.rid}; it was stopped, other requests go on",
            type="internal_error",
            code="request_failed",
        ) from None
    except RuntimeError as exc:
        raise ApiError(503, f"engine unavailable: {exc}", type="service_unavailable") from None


def in_band(exc: Exception, renames: dict[str, str] | None = None) -> ApiError:
    """The error a stream reports in its events once its status line has gone: the one `engine_errors` would have
    answered with (a grammar that failed mid-stream is a 400 naming its field), else 503 "engine failed"."""
    try:
        with engine_errors(None, renames):
            raise exc
    except ApiError as err:
        return err
    except Exception:  # noqa: BLE001 - anything else means the engine could not go on
        return ApiError(503, f"engine failed: {exc}", type="service_unavailable")


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue


async def unless_disconnected(request: Request, aw: Awaitable[T], on_gone: Any = None) -> T:
    """Await `aw` as a task; if the client disconnects first, cancel it, call on_gone() and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()  # the client left first (or this handler is being cancelled)
        if gone:
            task.cancel()
            if on_gone is not None:
                on_gone()
            with contextlib.suppress(BaseException):
                await task
    if gone:
        raise ClientGone()
    return task.result()


def abort_all(engine: Engine, rids: list[str | list[str] | None]) -> None:
    for rid in rids:
        for r in [rid] if isinstance(rid, str) else rid or []:
            engine.abort(r)


async def generate(request: Request, state: ServerState, calls: list[GenerateRequest]) -> list[list[GenerateOutput]]:
    """Run engine calls (each with its rid set) as one batch: tokenized concurrently, then queued together
    (Engine.run_all), so they reach the scheduler in one step; one list of outputs per call."""
    eng = state.engine
    rids = [c.rid for c in calls]

    async def run() -> list[list[GenerateOutput]]:
        outs = await eng.run_all(list(await asyncio.gather(*(tokenized(eng, c) for c in calls))))
        charge(sum(o.meta_info.prompt_tokens + o.meta_info.completion_tokens for group in outs for o in group))
        return outs

    return await unless_disconnected(request, run(), on_gone=lambda: abort_all(eng, rids))


@dataclass
class Stream:
    """One engine stream whose first chunk has arrived (so its input was accepted)."""

    rid: str
    first: StreamChunk
    rest: AsyncIterator[StreamChunk]
    finished: bool = False
    charged: int = 0  # tokens counted against the key's quota so far

    def took(self, chunk: StreamChunk) -> None:
        """A chunk was read: note whether it ends the stream, and charge its new tokens to the key's quota."""
        meta = chunk.meta_info
        self.finished = meta.finish_reason is not None
        total = meta.prompt_tokens + meta.completion_tokens
        charge(total - self.charged)
        self.charged = total


async def tokenized(eng: Engine, call: GenerateRequest) -> GenerateRequest:
    """The call with a text prompt replaced by its ids, tokenized in a thread, and its grammars (regex, json_schema,
    ebnf) compiled on the compiler's thread: the event loop never waits for either (it then finds the grammar cached).
    A grammar is awaited, not waited for in a worker thread, so grammars queued behind a costly one hold none of the
    threads that tokenize everyone's prompts."""
    if _names_grammar(call.sampling_params):
        jobs = await asyncio.to_thread(eng.grammar_jobs, call.sampling_params)  # canonical JSON of a big schema
        for job in jobs:
            built(await asyncio.wrap_future(job))
    prompt = call.prompt
    if prompt is None:
        return call
    ids = await asyncio.to_thread(eng.encode_prompts, prompt)
    return replace(call, prompt=None, input_ids=ids[0] if isinstance(prompt, str) else ids)


def _names_grammar(params: Any) -> bool:
    return any(
        isinstance(p, dict) and any(p.get(f) is not None for f in ("regex", "json_schema", "ebnf"))
        for p in (params if isinstance(params, list) else [params])
    )


async def open_streams(request: Request, state: ServerState, calls: list[GenerateRequest]) -> list[Stream]:
    """Start one engine stream per call, queued together (Engine.stream_all: they reach the scheduler in one step,
    as a batch does), and wait for every first chunk, so bad input fails before any byte is sent."""
    eng = state.engine
    rids = [c.rid for c in calls]

    async def start() -> list[Stream]:
        its = eng.stream_all(list(await asyncio.gather(*(tokenized(eng, c) for c in calls))))
        firsts = [asyncio.ensure_future(it.__anext__()) for it in its]
        try:
            await asyncio.gather(*firsts)
        except BaseException:  # one failed, or this is cancelled: end them all
            abort_all(eng, rids)
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for it in its:
                await it.aclose()  # type: ignore[attr-defined]
            raise
        return [
            Stream(c.rid, f.result(), it, finished=f.result().finished)
            for c, f, it in zip(calls, firsts, its, strict=True)
        ]

    return await unless_disconnected(request, start(), on_gone=lambda: abort_all(eng, rids))


async def close_streams(eng: Engine, streams: list[Stream]) -> None:
    """Abort what has not finished, then close the iterators (idempotent)."""
    for s in streams:  # aborting is synchronous: it happens even if this task is being cancelled
        if not s.finished:
            eng.abort(s.rid)
            s.finished = True
    for s in streams:
        # an iterator still held by a cancelled pump task refuses aclose(); it is aborted already, and
        # asyncio finalizes it when the task lets go
        with contextlib.suppress(RuntimeError):
            await s.rest.aclose()


async def merged(streams: list[Stream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of all streams as (stream index, chunk), first chunks first, then in arrival order."""
    for i, s in enumerate(streams):
        s.took(s.first)
        yield i, s.first
    if len(streams) == 1:
        s = streams[0]
        if not s.finished:
            async for chunk in s.rest:
                s.took(chunk)
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: Stream) -> None:
        try:
            async for chunk in s.rest:
                await queue.put((i, chunk))
        except Exception as exc:  # surfaced to the consumer below
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams) if not s.finished]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                streams[i].took(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the iterators must be idle before anyone closes them


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed (so its engine requests are aborted), even on disconnect."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


# JSON leaves U+0085, U+2028 and U+2029 raw inside strings, but line readers (Python's str.splitlines, httpx's
# iter_lines, JavaScript before ES2019) end a line there and would cut a `data:` line of sampled text in two.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_json(encoder: msgspec.json.Encoder, obj: Any) -> bytes:
    """`obj` as JSON that holds no character any line reader splits on (the three are escaped, the same string)."""
    data = encoder.encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse(state: ServerState, obj: Any) -> bytes:
    return b"data: " + sse_json(state.json, obj) + b"\n\n"
