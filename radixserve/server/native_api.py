"""SGLang-native endpoints beside /generate (generate_api.py): /tokenize, /detokenize, /flush_cache,
/get_model_info, /health, /metrics (/server_info and /abort_request have modules of their own)."""

from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.auth import forbidden, principal_of
from radixserve.server.errors import ApiError, bad_request
from radixserve.server.protocol import DetokenizeRequest, TokenizeRequest
from radixserve.server.serving import read_json, server_state


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
    """An admin key drops every cached page (409 while requests run: nothing is flushed then), or with `?key=NAME`
    the unlocked pages of that key's namespaces; a user key drops the unlocked pages of its own namespaces only
    (other tenants' entries stay, so flushing says nothing about them)."""
    state = server_state(request)
    who = principal_of(request)
    name = request.query_params.get("key")
    if name is not None or not who.is_admin:
        target = who if name is None or name == who.name else None
        if target is None:
            if not who.is_admin:
                raise forbidden("flushing another key's namespace")
            target = state.keys.named(name) if state.keys is not None else None
            if target is None:
                raise ApiError(404, f"no key is named {name!r}", param="key", type="not_found_error")
        pages = await asyncio.to_thread(state.engine.flush_cache, target.owns)
        return JSONResponse(
            {"success": True, "message": f"cache of key {target.name!r} flushed", "flushed_pages": pages}
        )
    if not await asyncio.to_thread(state.engine.flush_cache):
        raise ApiError(409, "cache not flushed: requests are running", type="conflict_error", code="requests_running")
    return JSONResponse({"success": True, "message": "cache flushed"})


async def get_model_info(request: Request) -> Response:
    """The engine's model_info plus what a client needs to render prompts itself: chat template, special tokens."""
    state = server_state(request)
    tok = state.engine.tokenizer
    info = state.engine.model_info()
    if principal_of(request).is_admin:
        info["tokenizer_path"] = info["model_path"]  # SGLang's key: the tokenizer is the model's own here
    else:
        info.pop("model_path")  # where the server keeps its files is the operator's business
    return JSONResponse(
        {
            **info,
            "served_model_name": state.model_name,
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "chat_template": tok.select_chat_template(),
            "special_tokens": tok.special_tokens,
        }
    )


async def health(request: Request) -> Response:
    """200 while the engine loop is alive and answering and the server admits requests; 503 otherwise."""
    state = server_state(request)
    if state.draining or not state.engine.is_alive():
        return Response(status_code=503)
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    """Admin keys read every figure; a user key reads only its own key's counters."""
    state = server_state(request)
    who = principal_of(request)
    # reading engine state waits for its loop: off the event loop
    body = await asyncio.to_thread(state.metrics.render, None if who.is_admin else who.name)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
