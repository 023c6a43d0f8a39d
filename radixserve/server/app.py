"""The starlette app: routes, middleware (request counting, API keys) and error handlers around one Engine."""

from __future__ import annotations

import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.server.agent_retention import ToolGaps
from radixserve.server import (
    abort_api,
    cache_api,
    chat_api,
    completions_api,
    generate_api,
    messages_api,
    native_api,
    responses_api,
    server_info,
)
from radixserve.server.auth import ApiKeyAuth
from radixserve.server.chat_prompt import ChatPromptBuilder
from radixserve.server.dashboard import Explorer, dashboard_routes
from radixserve.server.errors import ApiError, api_error_handler, http_exception_handler, internal_error_handler
from radixserve.server.metrics import RequestCounter, ServerMetrics
from radixserve.server.openapi import openapi_document
from radixserve.server.quotas import QuotaBook, QuotaGate
from radixserve.server.reasoning import REASONING_PARSERS
from radixserve.server.response_store import ResponseStore
from radixserve.server.serving import ClientGone, ServerState
from radixserve.server.tenants import KeyRing
from radixserve.server.timeouts import BodyTimeout, BodyTimeoutMiddleware, body_timeout_handler

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client left and its request was aborted


async def _openapi(request: Request) -> Response:
    from radixserve import __version__

    state = request.app.state.server
    doc = openapi_document(f"radixserve: {state.model_name}", __version__, state.vocab_size)
    return JSONResponse(doc)


def build_app(
    engine: Any,
    api_key: str | list[str] | KeyRing | None = None,
    max_queued_requests: int | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    otlp_endpoint: str | None = None,
    tracer_provider: Any = None,
    incremental_streaming_output: bool = False,
    reasoning_parser: str = "auto",
    agent_retention: bool = True,
) -> Starlette:
    """The HTTP app over `engine`. api_key: a KeyRing, or `--api-key`-style entries (a str may hold several,
    separated by commas; admin unless an entry says `role=user`; one cache namespace each); None: no keys (an empty
    key is an error). max_queued_requests bounds the waiting queue (429 past it); the app's ServerState is at
    app.state.server. otlp_endpoint (or an OpenTelemetry tracer_provider, for tests) turns request spans on
    (app.state.tracer). incremental_streaming_output: /generate streams send deltas (SGLang's flag; default: the text
    so far in every event, as SGLang). reasoning_parser: which outputs have their `<think>` reasoning split from the
    answer (reasoning.REASONING_PARSERS). agent_retention: a chat turn that ends in tool calls keeps its prefix
    retained for the tool gap learned per tenant (radixserve/server/agent_retention.py)."""
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    info = engine.model_info()
    stats = engine.cache_stats()
    keys = api_key if isinstance(api_key, KeyRing) or api_key is None else KeyRing.from_keys(api_key)
    quotas = QuotaBook()
    metrics = ServerMetrics(engine, quotas, keys)
    state = ServerState(
        engine=engine,
        model_name=served_model_name or info["model_name"],
        model_path=info["model_path"],
        context_length=info["context_length"],
        vocab_size=info["vocab_size"],
        pool_tokens=stats["total_pages"] * stats["page_size"],
        created=int(time.time()),
        max_queued_requests=max_queued_requests,
        max_body_bytes=max_body_bytes,
        metrics=metrics,
        prompts=ChatPromptBuilder(engine.tokenizer),
        keys=keys,
        incremental_streaming_output=incremental_streaming_output,
        reasoning_parser=reasoning_parser,
        tool_gaps=ToolGaps() if agent_retention and engine.config.enable_radix_cache else None,
    )
    routes = [
        Route("/v1/chat/completions", chat_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", completions_api.completions, methods=["POST"]),
        Route("/v1/responses", responses_api.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete_response, methods=["DELETE"]),
        Route("/v1/messages", messages_api.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_api.count_tokens, methods=["POST"]),
        Route("/v1/models", server_info.models, methods=["GET"]),
        Route("/generate", generate_api.generate_endpoint, methods=["POST"]),
        Route("/tokenize", native_api.tokenize, methods=["POST"]),
        Route("/detokenize", native_api.detokenize, methods=["POST"]),
        Route("/flush_cache", native_api.flush_cache, methods=["POST", "GET"]),
        Route("/cache/pin", cache_api.pin, methods=["POST"]),
        Route("/cache/unpin", cache_api.unpin, methods=["POST"]),
        Route("/get_model_info", native_api.get_model_info, methods=["GET"]),
        Route("/abort_request", abort_api.abort_request, methods=["POST"]),
        Route("/server_info", server_info.server_info, methods=["GET"]),
        Route("/get_server_info", server_info.server_info, methods=["GET"]),
        Route("/health", native_api.health, methods=["GET"]),
        Route("/metrics", native_api.metrics, methods=["GET"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        *dashboard_routes(),
    ]
    middleware = [
        Middleware(BodyTimeoutMiddleware, seconds=body_timeout_s),
        Middleware(RequestCounter, metrics=metrics),
        Middleware(ApiKeyAuth, keys=keys),
        Middleware(QuotaGate, book=quotas),
    ]
    tracer = None
    if otlp_endpoint or tracer_provider is not None:
        from radixserve.server.tracing import RequestTracer, TraceparentMiddleware, otlp_provider

        tracer = RequestTracer(engine.tracker, tracer_provider or otlp_provider(otlp_endpoint or ""))
        middleware.append(Middleware(TraceparentMiddleware))
    handlers = {
        ApiError: api_error_handler,
        HTTPException: http_exception_handler,
        ClientGone: _client_gone,
        BodyTimeout: body_timeout_handler,
        Exception: internal_error_handler,
    }
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
    app.state.server = state
    app.state.responses = ResponseStore()  # stored /v1/responses (bounds and TTL in response_store.py)
    app.state.explorer = Explorer(engine, auth_required=keys is not None)
    app.state.tracer = tracer
    return app
