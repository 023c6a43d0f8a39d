"""What the server serves. `GET /server_info` (and SGLang's older name `/get_server_info`): the server's settings in
the shape of SGLang's answer, its server arguments at the top level plus `internal_states` and `version`. Clients read
it to learn how the server behaves: `incremental_streaming_output` says whether a /generate stream sends deltas or the
text so far. `GET /v1/models`: OpenAI's list of models, this server's one."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.auth import principal_of
from radixserve.server.protocol import ModelCard, ModelList
from radixserve.server.serving import server_state


async def server_info(request: Request) -> Response:
    """Settings any key may read; the model's path and the cache's figures (every tenant's) only for admin keys."""
    from radixserve import __version__

    state = server_state(request)
    info = state.engine.model_info()
    body = {
        "served_model_name": state.model_name,
        "context_length": state.context_length,
        "page_size": info["page_size"],
        "dtype": info["dtype"],
        "quantization": info["quantization"],
        "attention_backend": info["attention_backend"],
        "tp_size": info["tp"],
        "dp_size": 1,  # one engine per server (--dp puts a router in front of several)
        "max_total_num_tokens": state.pool_tokens,
        "max_queued_requests": state.max_queued_requests,
        "incremental_streaming_output": state.incremental_streaming_output,
        "sampling_defaults": info["sampling_defaults"],
        "speculative": info["speculative"],
        "version": __version__,
    }
    if principal_of(request).is_admin:
        body["model_path"] = body["tokenizer_path"] = info["model_path"]
        body["internal_states"] = [await asyncio.to_thread(state.engine.cache_stats)]  # waits for the engine loop
    return JSONResponse(body)


async def models(request: Request) -> Response:
    state = server_state(request)
    defaults = state.engine.sampling_defaults
    body = ModelList(
        [
            ModelCard(
                state.model_name, state.created, max_model_len=state.context_length, sampling_defaults=defaults or None
            )
        ]
    )
    return Response(state.json.encode(body), media_type="application/json")
