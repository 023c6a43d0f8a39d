"""The router's starlette app: the workers' API in front of them, plus /workers to add, remove and list workers."""

from __future__ import annotations

import asyncio
import hmac
import json

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.router import metrics
from radixserve.router.health import Upkeep, check
from radixserve.router.policy import CacheAware, CacheAwareConfig, make_policy
from radixserve.router.proxy import REQUEST_HEADERS, WORKER_HEADER, error, forward_generation
from radixserve.router.config import RouterConfig
from radixserve.router.state import Router
from radixserve.router.workers import WorkerPool

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def router_of(request: Request) -> Router:
    return request.app.state.router


async def generation(request: Request) -> Response:
    return await forward_generation(router_of(request), request)


async def any_worker(request: Request) -> Response:
    """Requests every worker answers alike (model list, tokenizer): the first healthy worker that answers."""
    router = router_of(request)
    body = await request.body()
    headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
    for w in router.pool.healthy():
        try:
            r = await router.client.request(
                request.method, w.url + request.url.path, content=body or None, headers=headers
            )
        except httpx.TransportError as exc:
            router.request_failed(w, type(exc).__name__)
            continue
        return Response(
            r.content, r.status_code, media_type=r.headers.get("content-type"), headers={WORKER_HEADER: w.url}
        )
    return error(503, "no healthy worker", "service_unavailable", "no_worker")


async def broadcast(request: Request, path: str) -> dict[str, int]:
    """Send the request (its body and auth headers) to every healthy worker at once: each worker's status (503 if
    unreachable)."""
    router = router_of(request)
    body = await request.body()
    headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}

    async def one(url: str) -> tuple[str, int]:
        try:
            r = await router.client.request(request.method, url + path, content=body or None, headers=headers)
            return url, r.status_code
        except httpx.TransportError:
            return url, 503

    return dict(await asyncio.gather(*(one(w.url) for w in router.pool.healthy())))


async def flush_cache(request: Request) -> Response:
    """Flush every worker's cache, and so the tree: what it says they hold is gone."""
    router = router_of(request)
    results = await broadcast(request, "/flush_cache")
    for url, status in results.items():
        if status == 200:
            router.policy.forget(url)
    ok = bool(results) and all(s == 200 for s in results.values())
    return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 409)


async def abort_request(request: Request) -> Response:
    """SGLang's /abort_request: a request may run on any worker, so every one is asked (each aborts only what the
    caller's key sent there)."""
    results = await broadcast(request, "/abort_request")
    if results and all(s == 200 for s in results.values()):
        return Response(status_code=200)
    return JSONResponse({"success": False, "workers": results}, status_code=502 if results else 503)


async def health(request: Request) -> Response:
    return Response(status_code=200 if router_of(request).pool.healthy() else 503)


async def metrics_endpoint(request: Request) -> Response:
    return Response(await metrics.render(router_of(request)), media_type=PROMETHEUS_TEXT)


def _worker_info(router: Router) -> list[dict]:
    tree = router.policy.tree if isinstance(router.policy, CacheAware) else None
    return [{**w.info(), "tree_chars": tree.size(w.url) if tree else 0} for w in router.pool.all()]


def _admin_denied(request: Request) -> Response | None:
    key = request.app.state.admin_key
    if key is None:
        return None
    header = request.headers.get("authorization", "")
    if hmac.compare_digest(header.encode(), f"Bearer {key}".encode()):
        return None
    return error(401, "changing workers needs `Authorization: Bearer <admin key>`", "authentication_error")


async def workers_endpoint(request: Request) -> Response:
    """GET: list. POST {"url": ...}: add (checked at once; 200 either way, `healthy` says how it went).
    DELETE ?url=...: remove (its running requests finish; it gets no new ones)."""
    router = router_of(request)
    if request.method == "GET":
        return JSONResponse({"policy": router.policy.name, "workers": _worker_info(router)})
    denied = _admin_denied(request)
    if denied is not None:
        return denied
    if request.method == "POST":
        try:
            url = json.loads(await request.body())["url"]
            worker, new = router.add_worker(url)
        except (ValueError, KeyError, TypeError) as exc:
            return error(400, f'send {{"url": "http://host:port"}}: {exc}', "invalid_request_error")
        if new:
            upkeep: Upkeep = request.app.state.upkeep
            router.health_result(worker, await asyncio.to_thread(check, upkeep.client, worker))
            worker.healthy = worker.failures == 0  # a new worker takes traffic only once it answers /health
        return JSONResponse({"added": new, "worker": worker.info()})
    url = request.query_params.get("url")
    if not url:
        return error(400, "DELETE /workers?url=http://host:port", "invalid_request_error")
    try:
        removed = router.remove_worker(url)
    except ValueError as exc:
        return error(400, str(exc), "invalid_request_error")
    if removed is None:
        return error(404, f"no worker {url}", "not_found_error")
    return JSONResponse({"removed": removed.info()})


def build_router_app(
    worker_urls: list[str],
    policy: str = "cache_aware",
    cache: CacheAwareConfig | None = None,
    config: RouterConfig | None = None,
    admin_key: str | None = None,
    start_upkeep: bool = True,
) -> Starlette:
    """The router over worker_urls; app.state.router is its state, app.state.upkeep its health/eviction thread
    (started unless start_upkeep is False: tests drive checks themselves). Call app.state.close() when done."""
    pool = WorkerPool()
    router = Router(pool, make_policy(policy, cache), config or RouterConfig())
    for url in worker_urls:
        router.add_worker(url)
    routes = [
        Route("/v1/chat/completions", generation, methods=["POST"]),
        Route("/v1/completions", generation, methods=["POST"]),
        Route("/generate", generation, methods=["POST"]),
        Route("/v1/models", any_worker, methods=["GET"]),
        Route("/get_model_info", any_worker, methods=["GET"]),
        Route("/server_info", any_worker, methods=["GET"]),
        Route("/get_server_info", any_worker, methods=["GET"]),
        Route("/tokenize", any_worker, methods=["POST"]),
        Route("/detokenize", any_worker, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/workers", workers_endpoint, methods=["GET", "POST", "DELETE"]),
    ]
    app = Starlette(routes=routes)
    upkeep = Upkeep(router)
    if start_upkeep:
        upkeep.start()
    app.state.router = router
    app.state.upkeep = upkeep
    app.state.admin_key = admin_key
    app.state.close = upkeep.stop
    return app
