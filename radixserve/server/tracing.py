"""OpenTelemetry spans of request timelines (off by default; `--otlp-endpoint URL` turns them on).

Each finished request becomes a `radixserve.request` span (a child of the incoming `traceparent`, when the HTTP request
had one) with children `radixserve.queued`, `radixserve.prefill_chunk` (one per chunk), `radixserve.decode` (one per
run of decode steps, each step a `decode_step` event) and `radixserve.requeued` (after a retraction, which is also a
`retraction` event). Spans are built on an exporter thread from the finished timeline, never on the engine loop.
"""

from __future__ import annotations

from radixserve.log_bounds import bounded_logger

import queue
import threading
from typing import Any
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.timeline import RequestTimeline, Span, Tracker, traceparent

log = bounded_logger("radixserve.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()
SPAN_NAMES = {
    "queued": "radixserve.queued",
    "prefill": "radixserve.prefill_chunk",
    "decode": "radixserve.decode",
    "retracted": "radixserve.requeued",
}


def otlp_provider(endpoint: str) -> TracerProvider:
    """A provider exporting over OTLP/HTTP to `endpoint` (a collector's base URL gets /v1/traces appended)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": "radixserve"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class TraceparentMiddleware:
    """Carries the incoming `traceparent` header to the Engine (which copies it into the request's timeline)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = next((v for k, v in scope.get("headers", ()) if k == b"traceparent"), None)
        if scope["type"] != "http" or value is None:
            await self.app(scope, receive, send)
            return
        token = traceparent.set(value.decode("latin-1"))
        try:
            await self.app(scope, receive, send)
        finally:
            traceparent.reset(token)


class RequestTracer:
    """Turns each finished timeline of `tracker` into spans, on its own thread."""

    def __init__(self, tracker: Tracker, provider: Any) -> None:
        self.tracker = tracker
        self.provider = provider
        self.tracer = provider.get_tracer("radixserve")
        self.queue: queue.Queue[RequestTimeline | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="radixserve-tracing", daemon=True)
        self.thread.start()
        tracker.finish_listeners.append(self.queue.put)

    def _run(self) -> None:
        while (tl := self.queue.get()) is not None:
            try:
                self.export(tl)
            except Exception:  # noqa: BLE001 - a bad span must not stop tracing the next requests
                log.exception("could not export the spans of request %s", tl.rid)
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def flush(self) -> None:
        """Wait until every timeline handed over so far is exported (then flush the provider's processors)."""
        self.queue.join()
        self.provider.force_flush()

    def close(self) -> None:
        if self.queue.put in self.tracker.finish_listeners:
            self.tracker.finish_listeners.remove(self.queue.put)
        self.queue.put(None)

    def _ns(self, perf: float) -> int:
        return int(self.tracker.wall(perf) * 1e9)

    def export(self, tl: RequestTimeline) -> None:
        parent = _PROPAGATOR.extract({"traceparent": tl.traceparent}) if tl.traceparent else None
        root = self.tracer.start_span(
            "radixserve.request",
            context=parent,
            start_time=self._ns(tl.created),
            attributes={
                "radixserve.rid": tl.rid,
                "radixserve.prompt_tokens": tl.prompt_tokens,
                "radixserve.cached_tokens": tl.cached_tokens,
                "radixserve.completion_tokens": tl.completion_tokens,
                "radixserve.decode_steps": tl.decode_steps,
                "radixserve.retractions": tl.retractions,
                "radixserve.finish_reason": tl.finish_reason or "",
            },
        )
        ctx = trace.set_span_in_context(root)
        decode: list[Span] = []
        for s in list(tl.spans) + [Span("end", tl.finished or tl.created)]:
            if s.kind == "decode":
                decode.append(s)
                continue
            if decode:
                self._decode_span(decode, ctx)
                decode = []
            if s.kind == "end":
                break
            if s.kind == "retracted":
                root.add_event("retraction", timestamp=self._ns(s.start))
            attrs = (
                {"radixserve.chunk_tokens": s.tokens, "radixserve.prefix_tokens": s.prefix}
                if (s.kind == "prefill")
                else {}
            )
            child = self.tracer.start_span(
                SPAN_NAMES[s.kind], context=ctx, start_time=self._ns(s.start), attributes=attrs
            )
            child.end(end_time=self._ns(s.end if s.end is not None else s.start))
        root.end(end_time=self._ns(tl.finished or tl.created))

    def _decode_span(self, steps: list[Span], ctx: Any) -> None:
        span = self.tracer.start_span(
            "radixserve.decode",
            context=ctx,
            start_time=self._ns(steps[0].start),
            attributes={"radixserve.decode_steps": len(steps)},
        )
        for s in steps:
            span.add_event("decode_step", timestamp=self._ns(s.end if s.end is not None else s.start))
        last = steps[-1]
        span.end(end_time=self._ns(last.end if last.end is not None else last.start))
