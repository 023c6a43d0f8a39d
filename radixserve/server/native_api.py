"""SGLang-native endpoints: /generate, /tokenize, /detokenize, /flush_cache, /get_model_info, /health, /metrics.

/generate answers with the engine's output dicts as they are ({"text", "output_ids", "meta_info"}, a list for a batch
or n > 1). Streamed, each event is one engine chunk: text, output_ids and output logprobs hold only what is new,
meta_info counts are cumulative, and the last event has the finish_reason; then `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.cache_api import pin_first
from radixserve.server.errors import ApiError, bad_request
from radixserve.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from radixserve.server.serving import (
    SSE_DONE, EventStream, ServerState, Stream, admit, cache_salt, close_streams, engine_errors, generate, merged,
    open_streams, read_json, server_state, sse,
)
from radixserve.tokenizer import Tokenizer

LOGPROB_KEYS = ("output_token_logprobs", "input_token_logprobs")
TOP_LOGPROB_KEYS = ("output_top_logprobs", "input_top_logprobs")


def _with_text(tok: Tokenizer, entries: list | None) -> list | None:
    return None if entries is None else [(lp, t, tok.token_to_str(t)) for lp, t in entries]


def add_token_text(tok: Tokenizer, out: dict) -> dict:
    """return_text_in_logprobs: (logprob, id) -> (logprob, id, token text), as SGLang reports them."""
    meta = dict(out["meta_info"])
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = _with_text(tok, meta[key])
    for key in TOP_LOGPROB_KEYS:
        if key in meta:
            meta[key] = [_with_text(tok, top) for top in meta[key]]
    return {**out, "meta_info": meta}


def generate_call(req: GenerateRequest, salt: str) -> tuple[dict[str, Any], int]:
    """The engine call for a /generate body and how many prompts it holds (for admission)."""
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
    rid: str | list[str] | None = req.rid
    if rid is None:
        base = uuid.uuid4().hex
        rid = [f"{base}-{i}" for i in range(count)] if batch else base
    params = req.sampling_params
    ns = [p.get("n") for p in (params if isinstance(params, list) else [params or {}])]
    n = max((v for v in ns if isinstance(v, int)), default=1)  # bad values: the engine names them
    if req.stream and (batch or n != 1):
        raise bad_request("stream takes a single prompt with n == 1", param="stream")
    call = dict(prompt=req.text, input_ids=req.input_ids, sampling_params=params, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num, cache_salt=salt,
                rid=rid)
    return call, count * max(n, 1)


async def generate_endpoint(request: Request) -> Response:
    state = server_state(request)
    req = await read_json(request, GenerateRequest)
    call, count = generate_call(req, cache_salt(request, req.cache_salt))
    await admit(state, count)
    default_param = "text" if req.text is not None else "input_ids"
    tok = state.engine.tokenizer
    if req.pin:
        await pin_first(state, call_prompts(call), call["cache_salt"], default_param)
    if req.stream:
        with engine_errors(default_param):
            streams = await open_streams(request, state, [call])
        return EventStream(generate_events(state, streams[0], req.return_text_in_logprobs))
    with engine_errors(default_param):
        [outs] = await generate(request, state, [call])
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] == "abort":
            raise ApiError(503, f"request aborted: {o['meta_info']['finish_reason'].get('message')}",
                           type="service_unavailable")
        state.metrics.observe(o["meta_info"])
    if req.return_text_in_logprobs:
        outs = [add_token_text(tok, o) for o in outs]
    single = not isinstance(call["rid"], list) and len(outs) == 1
    return Response(state.json.encode(outs[0] if single else outs), media_type="application/json")


def call_prompts(call: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt of a /generate call, as keyword arguments of Engine.pin."""
    texts, ids = call["prompt"], call["input_ids"]
    if texts is not None:
        return [{"prompt": t} for t in (texts if isinstance(texts, list) else [texts])]
    return [{"input_ids": i} for i in (ids if ids and isinstance(ids[0], list) else [ids])]


async def generate_events(state: ServerState, stream: Stream, text_in_logprobs: bool) -> AsyncIterator[bytes]:
    """SSE of the engine's chunks as they come (text, output_ids and output logprobs hold only what is new), [DONE]."""
    tok = state.engine.tokenizer
    try:
        async with contextlib.aclosing(merged([stream])) as chunks:
            async for _, c in chunks:
                yield sse(state, add_token_text(tok, c) if text_in_logprobs else c)
                if c["meta_info"]["finish_reason"] is not None:
                    state.metrics.observe(c["meta_info"])
    except Exception as exc:  # the status line is gone: report in-band, as the OpenAI routes do
        yield sse(state, {"error": {"message": f"engine failed: {exc}", "type": "service_unavailable"}})
    finally:
        await close_streams(state.engine, [stream])
    yield SSE_DONE


async def tokenize(request: Request) -> Response:
    """{"prompt": str, "add_special_tokens": bool = true} -> {"tokens", "count", "max_model_len"}."""
    state = server_state(request)
    req = await read_json(request, TokenizeRequest)
    tokens = await asyncio.to_thread(state.engine.tokenizer.encode, req.prompt, req.add_special_tokens)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.context_length})


async def detokenize(request: Request) -> Response:
    """{"tokens": [int], "skip_special_tokens": bool = false} -> {"prompt": str}."""
    state = server_state(request)
    req = await read_json(request, DetokenizeRequest)
    if any(not 0 <= t < state.vocab_size for t in req.tokens):
        raise bad_request(f"tokens must be in [0, {state.vocab_size})", param="tokens")
    return JSONResponse({"prompt": state.engine.tokenizer.decode(req.tokens, req.skip_special_tokens)})


async def flush_cache(request: Request) -> Response:
    """Drop every cached page; 409 while requests run (nothing is flushed then)."""
    state = server_state(request)
    if not await asyncio.to_thread(state.engine.flush_cache):
        raise ApiError(409, "cache not flushed: requests are running", type="conflict_error", code="requests_running")
    return JSONResponse({"success": True, "message": "cache flushed"})


async def get_model_info(request: Request) -> Response:
    """The engine's model_info plus what a client needs to render prompts itself: chat template, special tokens."""
    state = server_state(request)
    tok = state.engine.tokenizer
    return JSONResponse({**state.engine.model_info(), "served_model_name": state.model_name, "is_generation": True,
                         "chat_template": tok.select_chat_template(), "special_tokens": tok.special_tokens})


async def health(request: Request) -> Response:
    """200 while the engine loop is alive and answering and the server admits requests; 503 otherwise."""
    state = server_state(request)
    if state.draining or not state.engine.is_alive():
        return Response(status_code=503)
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    state = server_state(request)
    body = await asyncio.to_thread(state.metrics.render)  # reading engine state waits for its loop: off the event loop
    return Response(body, media_type=CONTENT_TYPE_LATEST)
