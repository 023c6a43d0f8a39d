"""Pinning endpoints: `POST /cache/pin` keeps a prompt's cached prefix out of eviction (up to the engine's
max_pinned_share of the pool), `POST /cache/unpin` releases it. A pin is per cache namespace (API key and
cache_salt), as every cached page is."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.errors import bad_request
from radixserve.server.protocol import PinRequest
from radixserve.server.serving import admit, cache_salt, engine_errors, read_json, server_state


def _prompt(req: PinRequest) -> dict:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("pass exactly one of text or input_ids", param="text")
    return {"prompt": req.text, "input_ids": req.input_ids}


async def pin(request: Request) -> Response:
    """{"text" | "input_ids", "cache_salt"?} -> {"success", "pinned_tokens", "prompt_tokens"}; 400 past the share."""
    state = server_state(request)
    req = await read_json(request, PinRequest)
    prompt = _prompt(req)
    await admit(state)  # pinning computes the prompt first, like a request
    with engine_errors("text" if req.text is not None else "input_ids"):
        out = await asyncio.to_thread(state.engine.pin, **prompt, cache_salt=cache_salt(request, req.cache_salt))
    return JSONResponse({"success": True, **out})


async def unpin(request: Request) -> Response:
    """Same body as /cache/pin -> {"success": whether such a pin existed}."""
    state = server_state(request)
    req = await read_json(request, PinRequest)
    prompt = _prompt(req)
    with engine_errors("text" if req.text is not None else "input_ids"):
        ok = await asyncio.to_thread(state.engine.unpin, **prompt, cache_salt=cache_salt(request, req.cache_salt))
    return JSONResponse({"success": ok})
