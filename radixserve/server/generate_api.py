"""`/generate` (SGLang's native endpoint): text or token ids, one prompt or a batch, answered with the engine's
outputs as they are ({"text", "output_ids", "meta_info"}, a list for a batch or n > 1). Streamed, each event holds,
as SGLang's server sends it, the whole text, output_ids and output logprobs so far (or with
--incremental-streaming-output only what is new since the last event); meta_info counts are cumulative, and the last
event has the finish_reason; then `data: [DONE]`. The request runs through serving.py's engine calls directly (it
has no Job: its shapes are SGLang's), in handler.py's order of stages.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixserve.io import GenerateOutput, GenerateRequest, OutputMeta, StreamChunk
from radixserve.server.auth import principal_of
from radixserve.server.errors import bad_request
from radixserve.server.handler import json_response, parse, pin_first
from radixserve.server.protocol import GenerateBody
from radixserve.server.sglang_fields import refuse_unbuilt
from radixserve.server.serving import (
    SSE_DONE,
    EventStream,
    ServerState,
    Stream,
    aborted,
    admit,
    cache_salt,
    close_streams,
    engine_errors,
    generate,
    in_band,
    merged,
    open_streams,
    scheduling,
    sse,
)
from radixserve.tokenizer import Tokenizer

Out = TypeVar("Out", bound=GenerateOutput)
LOGPROB_KEYS = ("output_token_logprobs", "input_token_logprobs")
OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")  # one entry per token
INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
TOP_LOGPROB_KEYS = (
    "output_top_logprobs",
    "input_top_logprobs",
    "output_token_ids_logprobs",
    "input_token_ids_logprobs",
)


async def generate_endpoint(request: Request) -> Response:
    state, req = await parse(request, GenerateBody)
    salt = req.cache_salt if req.extra_key is None else f"{req.cache_salt or ''}|extra:{req.extra_key}"
    call, count = generate_call(req, cache_salt(request, salt))
    call = replace(call, **scheduling(request, req.priority, req.timeout))
    label = labeler(call.rid, req.rid)
    internal = call.rid if isinstance(call.rid, list) else [call.rid]
    labels = req.rid if isinstance(req.rid, list) else [req.rid] * len(internal)
    tracking = state.live.track(principal_of(request).name, list(zip(labels, internal)))  # for /abort_request
    await admit(state, count)
    default_param = "text" if req.text is not None else "input_ids"
    tok = state.engine.tokenizer
    if req.pin:
        await pin_first(state, call_prompts(call), call.cache_salt, default_param)
    if req.stream:
        with engine_errors(default_param):
            streams = await open_streams(request, state, [call])
        if not state.incremental_streaming_output:
            label = _then(label, Cumulative())
        return EventStream(generate_events(state, streams[0], req.return_text_in_logprobs, label, tracking))
    with tracking, engine_errors(default_param):
        [outs] = await generate(request, state, [call])
    for o in outs:
        fin = o.finish_reason
        if fin is not None and fin.type == "abort":
            raise aborted(fin)
        state.metrics.observe(o.meta_info)
    outs = [label(o) for o in outs]
    body: list[Any] = [add_token_text(tok, o) for o in outs] if req.return_text_in_logprobs else outs
    single = not isinstance(call.rid, list) and len(outs) == 1
    return json_response(state, body[0] if single else body)


# ---------------------------------------------------------------- build


def generate_call(req: GenerateBody, salt: str) -> tuple[GenerateRequest, int]:
    """The engine call for a /generate body and how many prompts it holds (for admission)."""
    refuse_unbuilt(req)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("pass exactly one of text or input_ids", param="text")
    if req.text is not None:
        count = len(req.text) if isinstance(req.text, list) else 1
        batch = isinstance(req.text, list)
    else:
        assert req.input_ids is not None
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        count = len(req.input_ids) if batch else 1
    if batch and count == 0:
        raise bad_request("the batch is empty", param="text" if req.text is not None else "input_ids")
    # The engine's ids are the server's own, unique per request: a client's rid is only a label (meta_info.id), so
    # another tenant sending the same rid can neither abort, read nor replace this request.
    # (The client's rid leads the server's id, so logs and error messages still name it.)
    base = uuid.uuid4().hex
    if req.rid is not None and (isinstance(req.rid, list) != batch or (batch and len(req.rid) != count)):
        raise bad_request("rid must be a string, or a list of strings with one entry per prompt", param="rid")
    given = req.rid if isinstance(req.rid, list) else [req.rid] * count
    own = [f"{g}@{base}-{i}" if g is not None else f"{base}-{i}" for i, g in enumerate(given)]
    rid: str | list[str] = own if batch else own[0].removesuffix("-0")
    params = req.sampling_params
    ns = [p.get("n") for p in (params if isinstance(params, list) else [params or {}])]
    n = max((v for v in ns if isinstance(v, int)), default=1)  # bad values: the engine names them
    if req.stream and (batch or n != 1):
        raise bad_request("stream takes a single prompt with n == 1", param="stream")
    call = GenerateRequest(
        prompt=req.text,
        input_ids=req.input_ids,
        sampling_params=params,
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len,
        top_logprobs_num=req.top_logprobs_num,
        cache_salt=salt,
        rid=rid,
        token_ids_logprob=req.token_ids_logprob,
        retention_seconds=req.retention_seconds,
        retention_priority=req.retention_priority,
    )
    return call, count * max(n, 1)


def labeler(internal: str | list[str] | None, given: str | list[str] | None) -> Callable[[Out], Out]:
    """Puts the client's rid (or the server's id if it gave none) into each output's meta_info.id."""
    if given is None or internal is None:
        return lambda out: out
    pairs = zip(internal, given) if isinstance(internal, list) else [(internal, given)]
    names = {i: str(g) for i, g in pairs}

    def label(out: Out) -> Out:
        own = out.meta_info.id
        for i, g in names.items():  # n > 1 makes ids "<rid>-<sample>"
            if own == i or own.startswith(i + "-"):
                return msgspec.structs.replace(
                    out, meta_info=msgspec.structs.replace(out.meta_info, id=g + own[len(i) :])
                )
        return out

    return label


def call_prompts(call: GenerateRequest) -> list[dict[str, Any]]:
    """Each prompt of a /generate call, as keyword arguments of Engine.pin."""
    texts, ids = call.prompt, call.input_ids
    if texts is not None:
        return [{"prompt": t} for t in (texts if isinstance(texts, list) else [texts])]
    return [{"input_ids": i} for i in (ids if ids and isinstance(ids[0], list) else [ids])]


# ---------------------------------------------------------------- shape


async def generate_events(
    state: ServerState,
    stream: Stream,
    text_in_logprobs: bool,
    label: Callable[[StreamChunk], StreamChunk],
    tracking: contextlib.AbstractContextManager[None],
) -> AsyncIterator[bytes]:
    """SSE of the engine's chunks as they come, each through `label` (which may make them cumulative), [DONE];
    the request is `tracking`'s while it streams."""
    tok = state.engine.tokenizer
    try:
        with tracking:
            async with contextlib.aclosing(merged([stream])) as chunks:
                async for _, c in chunks:
                    c = label(c)
                    yield sse(state, add_token_text(tok, c) if text_in_logprobs else c)
                    if c.finished:
                        state.metrics.observe(c.meta_info)
    except Exception as exc:  # the status line is gone: report in-band, as the OpenAI routes do
        err = in_band(exc)
        yield sse(state, {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
    finally:
        await close_streams(state.engine, [stream])
    yield SSE_DONE


def _then(
    first: Callable[[StreamChunk], StreamChunk], second: Callable[[StreamChunk], StreamChunk]
) -> Callable[[StreamChunk], StreamChunk]:
    return lambda c: second(first(c))


class Cumulative:
    """Turns a stream's chunks (what is new) into SGLang's default events: the text, output_ids and output logprobs
    so far, and the prompt logprobs (which come with the first chunk) in every event. Each event is encoded before
    the next chunk comes, so it may share the growing lists."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.lists: dict[str, list[Any]] = {k: [] for k in OUTPUT_LISTS}
        self.meta: OutputMeta | None = None  # the first chunk's: its prompt logprobs

    def __call__(self, c: StreamChunk) -> StreamChunk:
        self.text += c.text
        self.ids += c.output_ids
        m = c.meta_info
        first = self.meta = self.meta or m
        changes: dict[str, Any] = {k: getattr(first, k) for k in INPUT_LISTS}
        for key, so_far in self.lists.items():
            new = getattr(m, key)
            if new is not None:
                so_far += new
                changes[key] = so_far
        return StreamChunk(self.text, self.ids, msgspec.structs.replace(m, **changes))


def add_token_text(tok: Tokenizer, out: GenerateOutput) -> dict[str, Any]:
    """return_text_in_logprobs: the output's JSON with (logprob, id) -> (logprob, id, token text), as SGLang has it."""
    return with_token_text(tok, out.to_dict())


def with_token_text(tok: Tokenizer, d: dict[str, Any]) -> dict[str, Any]:
    """The same for an output already in its dict shape (the Engine's dict API); `d` is changed in place."""
    d["meta_info"] = meta = dict(d["meta_info"])
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = _with_text(tok, meta[key])
    for key in TOP_LOGPROB_KEYS:
        if key in meta:
            meta[key] = [_with_text(tok, top) for top in meta[key]]
    return d


def _with_text(tok: Tokenizer, entries: list | None) -> list | None:
    return None if entries is None else [(lp, t, tok.token_to_str(t)) for lp, t in entries]
