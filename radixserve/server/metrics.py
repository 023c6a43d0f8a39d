"""Prometheus metrics: engine gauges and counters read at scrape time, request latency histograms, HTTP counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.io import OutputMeta
from radixserve.server.quotas import KeyCollector, QuotaBook
from radixserve.server.retention_metrics import KeyRetentionCollector
from radixserve.server.tenants import KeyRing

PREFIX = "radixserve_"
ENGINE_GAUGES = {  # engine.metrics() key -> help
    "hit_rate": "fraction of prompt tokens served from the radix cache since start",
    "num_running": "requests running (prefill or decode)",
    "num_waiting": "requests waiting in the queue",
    "total_pages": "KV pages in the pool",
    "free_pages": "KV pages on the free list",
    "cached_pages": "KV pages whose KV a later request can reuse: the radix tree's and kept partial pages",
    "evictable_pages": "cached pages no running request or pin holds (evictable)",
    "locked_pages": "radix tree pages a running request or a pin holds",
    "partial_pages": "kept partial pages (a finished request's last, part-filled page, for row copies)",
    "private_pages": "pages running requests hold outside the radix tree",
    "device_bytes": "KV bytes held by the radix tree in the pool (device tier)",
    "pinned_pages": "radix tree pages pinned (/cache/pin)",
    "retained_pages": "radix tree pages retained ahead of LRU (cache_control, retention_seconds, agent turns)",
    "retained_bytes": "KV bytes of the retained pages",
    "retained_nodes": "radix tree nodes under retention",
    "retained_tenants": "tenants holding retained pages",
    "disk_pages": "KV pages in the disk tier (--kv-cache-dir)",
    "disk_bytes": "bytes of KV page files in the disk tier",
    "load_seconds_per_page": "mean time to load one page from the disk tier into the pool",
    "host_pages": "KV pages in the host-RAM tier (--kv-cache-host-gb)",
    "host_bytes": "bytes of KV pages in the host-RAM tier",
    "host_load_seconds_per_page": "mean time to load one page from the host-RAM tier into the pool",
}
ENGINE_COUNTERS = {  # engine.metrics() key (ending in _total) -> help
    "num_retractions": "running requests retracted to the queue on memory shortage",
    "prompt_tokens_total": "prompt tokens received",
    "generation_tokens_total": "tokens generated",
    "cached_tokens_total": "prompt tokens served from the radix cache",
    "partial_page_hit_tokens_total": "of those, tokens copied from a cached partial page",
    "computed_prefill_tokens_total": "prompt tokens computed by prefill",
    "device_hit_tokens_total": "prompt tokens served from pages already in the pool",
    "disk_hit_tokens_total": "prompt tokens served from pages loaded from the disk tier",
    "spilled_pages_total": "pages written to the disk tier (evictions and checkpoints)",
    "loaded_pages_total": "pages loaded from the disk tier into the pool",
    "load_seconds_total": "time spent loading pages from the disk tier",
    "host_hit_tokens_total": "prompt tokens served from pages loaded from the host-RAM tier",
    "host_spilled_pages_total": "pages copied from the pool to the host-RAM tier on eviction",
    "host_loaded_pages_total": "pages loaded from the host-RAM tier into the pool",
    "host_load_seconds_total": "time spent loading pages from the host-RAM tier (on a GPU: enqueueing the copies)",
    "retentions_total": "prefixes retained (a finished request's, or one retained by the server for an agent)",
    "retentions_refused_total": "retentions refused: over --max-retained-share, or larger than a tenant's share",
    "retention_expired_nodes_total": "radix tree nodes whose retention ran out (they went back to plain LRU)",
    "retention_displaced_nodes_total": "retained nodes decayed early to make room for their tenant's newer retention",
    "failed_requests_total": "requests ended by an internal error (each alone; the others went on)",
    "failed_steps_total": "model steps that failed (their newest request failed, the others ran again)",
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CHUNK_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/flush_cache",
    "/get_model_info",
    "/health",
    "/metrics",
    "/cache/pin",
    "/cache/unpin",
    "/dashboard",
    "/cache/tree",
    "/cache/why_miss",
    "/cache/stats",
    "/cache/events",
}


class EngineCollector(Collector):
    """Reads engine.metrics() once per scrape, so the gauges are never stale and the engine pushes nothing."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        for key, doc in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + key, doc, value=m[key])
        for key, doc in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + key.removesuffix("_total"), doc, value=m[key])
        if m.get("spec_enabled"):
            yield from _speculative_metrics(m)


def _speculative_metrics(m: dict[str, Any]) -> Iterator[Metric]:
    """Draft tokens proposed and accepted per source; tokens accepted per verify step, as a histogram."""
    for key, doc in (
        ("spec_draft_tokens", "speculative draft tokens proposed, by source (prompt, tree)"),
        ("spec_accepted_tokens", "speculative draft tokens accepted, by source (prompt, tree)"),
    ):
        family = CounterMetricFamily(PREFIX + key, doc, labels=["source"])
        for source, value in m[key].items():
            family.add_metric([source], value)
        yield family
    hist = m["spec_accepted_length_hist"]
    cumulative, buckets = 0, []
    for length, count in enumerate(hist):
        cumulative += count
        buckets.append((str(length), cumulative))
    buckets.append(("+Inf", cumulative))
    yield HistogramMetricFamily(
        PREFIX + "spec_accepted_drafts_per_step",
        "draft tokens a request accepted in one verify step",
        buckets=buckets,
        sum_value=sum(i * c for i, c in enumerate(hist)),
    )


class ServerMetrics:
    """One registry per app (nothing global): engine state plus what the HTTP layer measures."""

    def __init__(self, engine: Any, quotas: QuotaBook | None = None, keys: KeyRing | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.engine, self.quotas, self.keys = engine, quotas, keys
        if quotas is not None:
            self.registry.register(KeyCollector(quotas))
        if keys is not None:
            self.registry.register(KeyRetentionCollector(engine, keys))
        tracker = getattr(engine, "tracker", None)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "time from submission to the first output token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "time between consecutive output tokens of a request (one sample per token after the first)",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "time from submission to the last output token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # From the engine's request timelines (radixserve/timeline.py), observed on its loop thread after each step
        # or request: a histogram observe is a lock and a few adds.
        self.queue_time = Histogram(
            PREFIX + "queue_time_seconds",
            "time from submission to the first step run",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_chunk = Histogram(
            PREFIX + "prefill_chunk_tokens",
            "tokens in one request's prefill chunk",
            buckets=CHUNK_BUCKETS,
            registry=self.registry,
        )
        self.step_time = Histogram(
            PREFIX + "step_time_seconds",
            "time from scheduling a step to processing its result",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        if tracker is not None:
            tracker.step_listeners.append(self.on_step)
            tracker.finish_listeners.append(self.on_finish)

    def on_step(self, seconds: float, prefill_chunks: list[int]) -> None:
        self.step_time.observe(seconds)
        for n in prefill_chunks:
            self.prefill_chunk.observe(n)

    def on_finish(self, timeline: Any) -> None:
        if timeline.finish_reason == "abort":
            return
        if timeline.queue_time is not None:
            self.queue_time.observe(timeline.queue_time)
        last = timeline.first_token
        for span in timeline.spans:  # each decode step's result is one more token
            if span.kind == "decode" and span.end is not None and last is not None and span.end > last:
                self.itl.observe(span.end - last)
                last = span.end

    def observe(self, meta: OutputMeta) -> None:
        """Record one finished generation from its meta_info (engine-measured ttft and e2e_latency)."""
        if meta.finish_reason is not None and meta.finish_reason.type == "abort":
            return
        ttft, e2e, n = meta.ttft, meta.e2e_latency, meta.completion_tokens
        if ttft is not None and n > 0:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)

    def render(self, key_name: str | None = None) -> bytes:
        """Everything (what an admin reads), or with `key_name` only that key's own counters (what a user key reads:
        server-wide figures would tell it about the other tenants)."""
        if key_name is None:
            return generate_latest(self.registry)
        own = CollectorRegistry()
        if self.quotas is not None:
            own.register(KeyCollector(self.quotas, only=key_name))
        if self.keys is not None:
            own.register(KeyRetentionCollector(self.engine, self.keys, only=key_name))
        return generate_latest(own)


class RequestCounter:
    """ASGI middleware counting answered requests by route and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
