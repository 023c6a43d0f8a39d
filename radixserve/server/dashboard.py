"""The cache explorer: GET /dashboard (static page shipped in the package) and the JSON/SSE endpoints it reads.

  GET  /cache/tree?depth=&namespace=&max_nodes=&path=   bounded snapshot of the radix tree (cache_view.TreeReader)
  POST /cache/why_miss {text | input_ids | messages, cache_salt?, namespace?}   where a prompt's path leaves the tree
  GET  /cache/stats      pool occupancy, running/waiting requests, hit rate over time, recent request timelines
  GET  /cache/events     the same stats as server-sent events, once per `interval` seconds

Every read runs off the engine loop (see cache_view); the tree snapshot runs in a worker thread, so the event loop
keeps serving while it walks. What a caller may see is decided by scope.view_scope alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from importlib import resources
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from radixserve.server.cache_view import (
    DEFAULT_DEPTH,
    DEFAULT_NODES,
    MAX_DEPTH,
    MAX_NODES,
    TreeReader,
    pool_view,
    request_rows,
)
from radixserve.server.errors import ApiError, bad_request
from radixserve.server.scope import NamespaceScope, view_scope
from radixserve.server.chat_job import chat_messages
from radixserve.server.protocol import ChatMessage
from radixserve.server.serving import cache_salt, engine_errors, read_json, server_state, sse_json
from radixserve.timeline import RequestTimeline

STATIC = resources.files("radixserve.server") / "static"
HIT_RATE_POINTS = 600
SAMPLE_EVERY_S = 1.0
RECENT_TIMELINES = 40
PAGE_SPANS = 200  # spans per timeline sent to the page (each SSE tick encodes them all on the event loop)
TREE_TTL_S = 1.0  # a tree snapshot is reused this long for the same view: pollers share one walk


class WhyMissRequest(msgspec.Struct, forbid_unknown_fields=True):
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # as /v1/chat/completions takes them
    cache_salt: str | None = None
    namespace: str | None = None  # the admin may name any namespace; a tenant only its own


class HitRateHistory:
    """(wall time, hit rate of the interval, cumulative hit rate) about once a second, sampled on the loop thread
    after a step (a few int reads), so idle time costs nothing."""

    def __init__(self, engine: Any) -> None:
        self.stats = engine.scheduler.stats
        self.points: deque[tuple[float, float | None, float]] = deque(maxlen=HIT_RATE_POINTS)
        self._last = (0.0, 0, 0)

    def on_step(self, seconds: float, chunks: list[int]) -> None:
        self.sample()

    def sample(self) -> None:
        """Add a point if a second has passed (from the loop after a step, or from a reader)."""
        now = time.time()
        t, hit0, prompt0 = self._last
        if now - t < SAMPLE_EVERY_S:
            return
        hit, prompt = self.stats.hit_tokens, self.stats.prompt_tokens
        rate = (hit - hit0) / (prompt - prompt0) if prompt > prompt0 else None
        self.points.append((now, rate, hit / prompt if prompt else 0.0))
        self._last = (now, hit, prompt)


class Explorer:
    """The explorer's state for one app: the tree reader and the hit-rate history."""

    def __init__(self, engine: Any, auth_required: bool = False) -> None:
        self.engine = engine
        self.auth_required = auth_required  # the page then waits for a key before it asks for data
        tracker = engine.tracker
        self.tracker = tracker
        tok = engine.tokenizer

        def clock_age(clock: int) -> float | None:
            t = tracker.clock_time(clock)
            return None if t is None else round(time.perf_counter() - t, 3)

        self.tree = TreeReader(
            engine.scheduler.cache,
            engine.runner.pool.page_size,
            lambda ids: tok.decode(ids, skip_special_tokens=False),
            clock_age,
        )
        self.hit_rate = HitRateHistory(engine)
        tracker.step_listeners.append(self.hit_rate.on_step)
        self._trees: dict[tuple[Any, ...], tuple[float, bytes]] = {}

    def tree_json(
        self, scope: NamespaceScope, namespace: str | None, depth: int, max_nodes: int, path: list[str]
    ) -> bytes:
        """A snapshot as JSON, reused for TREE_TTL_S: the walk holds the GIL, so many pollers must not each walk
        (measured: a client fetching back to back slowed serving 2.6x before this; benchmarks/RESULTS.md)."""
        key = (scope.tenant, namespace, depth, max_nodes, tuple(path))
        now = time.monotonic()
        hit = self._trees.get(key)
        if hit is not None and now - hit[0] < TREE_TTL_S:
            return hit[1]
        body = msgspec.json.encode(self.tree.snapshot(scope, namespace, depth, max_nodes, path).to_dict())
        if len(self._trees) > 64:
            self._trees = {}
        self._trees[key] = (now, body)
        return body

    def stats(self, scope: NamespaceScope) -> dict[str, Any]:
        eng = self.engine
        s = eng.scheduler.stats
        self.hit_rate.sample()
        live = [
            r.timeline
            for r in list(eng.scheduler.running) + list(eng.scheduler.waiting)
            if r.timeline is not None and scope.allows(r.namespace)
        ]
        recent = [t for t in list(self.tracker.recent) if scope.allows(t.namespace)][-RECENT_TIMELINES:]
        return {
            "time": time.time(),
            "pool": pool_view(eng),
            "requests": request_rows(eng, scope),
            "hit_rate": {
                "total": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "points": [[round(t, 3), r, c] for t, r, c in list(self.hit_rate.points)],
            },
            "tree": {
                "nodes": getattr(eng.scheduler.cache, "_num_nodes", 0),
                "pages": eng.scheduler.cache.total_pages,
                "clock": getattr(eng.scheduler.cache, "_clock", 0),
            },
            "timelines": [timeline_dict(t, self.tracker.wall) for t in live + recent],
            "admin": scope.is_admin,
        }


def timeline_dict(tl: RequestTimeline, wall: Any) -> dict[str, Any]:
    """A timeline for the page: times in ms from submission; a long one keeps its first and last spans."""
    kept = list(tl.spans)
    omitted = max(len(kept) - PAGE_SPANS, 0)
    if omitted:
        kept = kept[: PAGE_SPANS // 4] + kept[-(PAGE_SPANS - PAGE_SPANS // 4) :]
    spans = [
        [
            s.kind,
            round((s.start - tl.created) * 1e3, 3),
            None if s.end is None else round((s.end - tl.created) * 1e3, 3),
            s.tokens,
            s.prefix,
        ]
        for s in kept
    ]
    return {
        "rid": tl.rid,
        "namespace": tl.namespace,
        "start": round(wall(tl.created), 3),
        "prompt_tokens": tl.prompt_tokens,
        "cached_tokens": tl.cached_tokens,
        "completion_tokens": tl.completion_tokens,
        "decode_steps": tl.decode_steps,
        "retractions": tl.retractions,
        "finish_reason": tl.finish_reason,
        "duration_ms": None if tl.finished is None else round((tl.finished - tl.created) * 1e3, 3),
        "spans": spans,
        "dropped_events": tl.dropped_events + omitted,
    }


def explorer(request: Request) -> Explorer:
    return request.app.state.explorer


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer", param=name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}]", param=name)
    return value


def _namespace_param(scope: NamespaceScope, namespace: str | None) -> str | None:
    if namespace is not None and not scope.allows(namespace):
        raise ApiError(403, "this key may not view that namespace", type="permission_error", code="namespace_forbidden")
    return namespace


async def cache_tree(request: Request) -> Response:
    scope = view_scope(request)
    q = request.query_params
    depth = _int_param(request, "depth", DEFAULT_DEPTH, 0, MAX_DEPTH)
    max_nodes = _int_param(request, "max_nodes", DEFAULT_NODES, 1, MAX_NODES)
    namespace = _namespace_param(scope, q.get("namespace") or None)
    path = [k for k in q.get("path", "").split(",") if k]
    if any(len(k) > 16 or any(c not in "0123456789abcdef" for c in k) for k in path):
        raise bad_request("path is a comma-separated list of 16-digit hex keys", param="path")
    body = await asyncio.to_thread(explorer(request).tree_json, scope, namespace, depth, max_nodes, path)
    return Response(body, media_type="application/json")


async def why_miss(request: Request) -> Response:
    state = server_state(request)
    scope = view_scope(request)
    body = await read_json(request, WhyMissRequest)
    given = [x is not None for x in (body.text, body.input_ids, body.messages)]
    if sum(given) != 1:
        raise bad_request("pass exactly one of text, input_ids or messages", param="text")
    namespace = cache_salt(request, body.cache_salt)
    if body.namespace is not None:
        namespace = _namespace_param(scope, body.namespace) or ""
    if body.text is not None:
        ids = (await asyncio.to_thread(state.engine.encode_prompts, [body.text]))[0]
    elif body.messages is not None:
        messages = chat_messages(body.messages)
        with engine_errors("messages"):
            ids = await asyncio.to_thread(state.prompts.build, messages, namespace)
    else:
        ids = list(body.input_ids or [])
        if any(not 0 <= t < state.vocab_size for t in ids):
            raise bad_request(f"input_ids must be in [0, {state.vocab_size})", param="input_ids")
    out = await asyncio.to_thread(_why_miss, explorer(request).tree, ids, namespace)
    return JSONResponse(out)


def _why_miss(tree: TreeReader, ids: list[int], namespace: str) -> dict[str, Any]:
    """The lookup reads the tree while the engine loop may split or evict a node it is reading: try again then."""
    for _ in range(2):
        try:
            return tree.why_miss(ids, namespace)
        except (IndexError, ValueError):
            continue
    return tree.why_miss(ids, namespace)


async def cache_stats(request: Request) -> Response:
    return JSONResponse(explorer(request).stats(view_scope(request)))


async def cache_events(request: Request) -> Response:
    """Server-sent events: one `stats` event per interval (default 1 s) until the client leaves."""
    interval = _int_param(request, "interval_ms", 1000, 100, 60000) / 1000
    scope = view_scope(request)
    exp = explorer(request)
    enc = msgspec.json.Encoder()

    state = server_state(request)

    async def events() -> Any:
        while not state.draining:  # a draining server ends the stream, so an open page never delays its exit
            yield b"event: stats\ndata: " + sse_json(enc, exp.stats(scope)) + b"\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def dashboard_page(request: Request) -> Response:
    html = (STATIC / "dashboard.html").read_text(encoding="utf-8")
    auth = "1" if explorer(request).auth_required else "0"
    return HTMLResponse(html.replace("<body>", f'<body data-auth="{auth}">', 1))


def dashboard_routes() -> list[Any]:
    return [
        Route("/dashboard", dashboard_page, methods=["GET"]),
        Mount("/dashboard/static", app=StaticFiles(directory=str(STATIC)), name="dashboard-static"),
        Route("/cache/tree", cache_tree, methods=["GET"]),
        Route("/cache/why_miss", why_miss, methods=["POST"]),
        Route("/cache/stats", cache_stats, methods=["GET"]),
        Route("/cache/events", cache_events, methods=["GET"]),
    ]
