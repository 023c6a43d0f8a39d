"""The cache explorer's endpoints against a live server on the tiny model, two tenants (API keys) and an admin view;
request timelines, OpenTelemetry spans (in-memory exporter) and the latency histograms (parsed by prometheus-client).
The page itself is driven in a browser by tests/test_dashboard_browser.py."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from engine_checks import engine_left_at_rest, wait_idle
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.tenants import tenant_of
from test_dashboard_parts import walk

PAGE = 4
ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
# `--api-key` entries are admins unless they say role=user: two tenants and the operator
KEYS = f"{ALICE} role=user,{BOB} role=user,{ADMIN}"
SECRET = "alpha secret plan for the red fox"
GREEDY = {"max_tokens": 4, "temperature": 0}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(
        tiny_model_dir, dtype="float32", page_size=PAGE, max_total_tokens=8192, chunked_prefill_size=16
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(engine: Engine, spans: InMemorySpanExporter) -> Iterator[BackgroundServer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    app = build_app(engine, api_key=KEYS, tracer_provider=provider)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv
    app.state.tracer.close()


@pytest.fixture(scope="module")
def admin(engine: Engine) -> Iterator[httpx.Client]:
    """No keys configured: the caller is the admin and sees every namespace."""
    with BackgroundServer(build_app(engine)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def client(server: BackgroundServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def chat_turns(c: httpx.Client, model: str, turns: list[str], headers: dict[str, str] | None = None) -> list[dict]:
    """A multi-turn conversation: each turn resends the history (so it hits the cache)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Remember: {SECRET}."}]
    metas = []
    for turn in turns:
        msgs.append({"role": "user", "content": turn})
        r = c.post("/v1/chat/completions", json={"model": model, "messages": msgs, **GREEDY}, headers=headers or {})
        assert r.status_code == 200, r.text
        body = r.json()
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        metas.append(body["usage"])
    return metas


@pytest.fixture(scope="module")
def workload(server: BackgroundServer, engine: Engine) -> list[dict]:
    model = engine.model_info()["model_name"]
    with client(server, ALICE) as c:
        usage = chat_turns(
            c,
            model,
            ["What is the plan?", "And then?", "Why the fox?"],
            headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
        )
    with client(server, BOB) as c:
        c.post("/v1/completions", json={"model": model, "prompt": "bob's own harmless prompt", **GREEDY})
    wait_idle(engine)
    return usage


def test_tree_shows_the_conversation_to_its_tenant_only(
    server: BackgroundServer, workload: list[dict], admin: httpx.Client
) -> None:
    assert workload[-1]["prompt_tokens_details"]["cached_tokens"] > 0, "later turns hit the cache"
    with client(server, ALICE) as a, client(server, BOB) as b:
        tree_a = a.get("/cache/tree").json()
        tree_b = b.get("/cache/tree").json()
        nodes_a = list(walk(tree_a["root"]))[1:]
        assert {n["namespace"] for n in nodes_a} == {tenant_of(ALICE)}
        assert any("alpha secret plan" in n["text"] for n in nodes_a), [n["text"] for n in nodes_a]
        # the system prompt's node is shared by the three turns: it has branches and hits
        shared = next(n for n in nodes_a if "alpha secret plan" in n["text"])
        assert shared["hits"] >= 2 and shared["pages"] > 0 and shared["num_children"] >= 1
        assert shared["age_s"] is not None and not shared["locked"]
        nodes_b = list(walk(tree_b["root"]))[1:]
        assert nodes_b and {n["namespace"] for n in nodes_b} == {tenant_of(BOB)}
        for path in ("/cache/tree", "/cache/stats"):
            assert "alpha secret" not in b.get(path).text, f"{path} leaks another tenant's text"
        assert "bob's own" not in a.get("/cache/tree").text
        r = b.get("/cache/tree", params={"namespace": tenant_of(ALICE)})
        assert r.status_code == 403 and r.json()["error"]["code"] == "namespace_forbidden"
        assert httpx.get(server.url + "/cache/tree").status_code == 401
    everything = admin.get("/cache/tree").json()
    assert {n["namespace"] for n in list(walk(everything["root"]))[1:]} == {tenant_of(ALICE), tenant_of(BOB)}


def test_tree_is_collapsed_to_the_node_budget_and_zooms_by_path(server: BackgroundServer, workload: list[dict]) -> None:
    with client(server, ALICE) as a:
        full = a.get("/cache/tree").json()
        assert not full["truncated"] and full["shown_nodes"] == len(list(walk(full["root"]))) - 1
        small = a.get("/cache/tree", params={"max_nodes": 1}).json()
        assert small["shown_nodes"] == 1 and small["truncated"]
        [top] = small["root"]["children"]
        assert top["hidden_children"] == top["num_children"] > 0
        shallow = a.get("/cache/tree", params={"depth": 1}).json()
        assert all(not c["children"] and c["hidden_children"] == c["num_children"] for c in shallow["root"]["children"])
        zoomed = a.get("/cache/tree", params={"path": top["key"]}).json()
        assert zoomed["root"]["id"] == top["id"] and zoomed["root"]["children"]
        assert a.get("/cache/tree", params={"depth": "-1"}).status_code == 400
        assert a.get("/cache/tree", params={"path": "nothex"}).status_code == 400
    with client(server, BOB) as b:  # another tenant's key in a path does not reach its node
        assert b.get("/cache/tree", params={"path": top["key"]}).json()["root"]["id"] == 0


def test_why_miss(server: BackgroundServer, engine: Engine, workload: list[dict]) -> None:
    with client(server, ALICE) as a:
        # the conversation's system prompt, then something the tree never saw
        r = a.post("/cache/why_miss", json={"text": f"<|im_start|>system\nRemember: {SECRET}. But zebra"}).json()
        assert r["reason"] in ("diverged", "no_child") and r["matched_tokens"] > 0
        assert r["cached_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
        assert r["path"] and r["path"][0]["pages_matched"] >= 1
        cold = a.post("/cache/why_miss", json={"text": "zebra zebra zebra zebra zebra"}).json()
        assert cold["reason"] == "cold" and cold["cached_tokens"] == 0
        other = a.post("/cache/why_miss", json={"text": "bob's own harmless prompt"}).json()
        assert other["reason"] == "cold", "another tenant's cached prompt is a miss in mine"
        assert a.post("/cache/why_miss", json={"text": "x", "input_ids": [1]}).status_code == 400
        assert a.post("/cache/why_miss", json={"text": "x", "namespace": tenant_of(BOB)}).status_code == 403


def test_why_miss_hit_on_a_repeated_prompt(server: BackgroundServer, engine: Engine) -> None:
    model = engine.model_info()["model_name"]
    prompt = "the same prompt twice, " * 4
    with client(server, ALICE) as a:
        a.post("/v1/completions", json={"model": model, "prompt": prompt, **GREEDY})
        r = a.post("/cache/why_miss", json={"text": prompt}).json()
    assert r["reason"] == "hit" and r["computed_tokens"] <= PAGE, r


def test_stats_and_event_stream(server: BackgroundServer, workload: list[dict]) -> None:
    with client(server, ALICE) as a:
        s = a.get("/cache/stats").json()
        p = s["pool"]
        assert p["free"] + p["cached_evictable"] + p["locked"] + p["in_flight"] == p["total"]
        assert p["cached_evictable"] > 0 and 0 < s["hit_rate"]["total"] < 1
        assert s["requests"] == {"running": [], "waiting": []}
        mine = [t for t in s["timelines"] if t["namespace"] == tenant_of(ALICE)]
        assert len(mine) == len(s["timelines"]) >= 3
        kinds = {span[0] for t in mine for span in t["spans"]}
        assert {"queued", "prefill", "decode"} <= kinds
        events = []
        with a.stream("GET", "/cache/events", params={"interval_ms": 100}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
        assert events[1]["time"] > events[0]["time"] and events[0]["pool"]["total"] == p["total"]


def test_dashboard_page_and_assets_are_served_without_a_key(server: BackgroundServer) -> None:
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and 'data-auth="1"' in page.text and "cdn" not in page.text.lower()
    for asset in ("dashboard.js", "dashboard.css"):
        r = httpx.get(f"{server.url}/dashboard/static/{asset}")
        assert r.status_code == 200 and len(r.content) > 1000
        text = r.text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace name, not a fetch
        assert "http://" not in text and "https://" not in text, "everything the page needs ships in the package"
    assert httpx.get(server.url + "/dashboard/static/../../cache/stats").status_code in (401, 404)


def test_spans_of_a_traced_request(server: BackgroundServer, spans: InMemorySpanExporter, workload: list[dict]) -> None:
    server.app.state.tracer.flush()
    done = spans.get_finished_spans()
    roots = [s for s in done if s.name == "radixserve.request" and s.context.trace_id == int(TRACE_ID, 16)]
    assert len(roots) == 3, "the three traced turns continue the caller's trace"
    root = roots[-1]
    assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7
    assert root.attributes["radixserve.cached_tokens"] > 0 and root.attributes["radixserve.finish_reason"]
    assert root.attributes["radixserve.prompt_tokens"] > root.attributes["radixserve.cached_tokens"]
    children = [s for s in done if s.parent is not None and s.parent.span_id == root.context.span_id]
    names = [s.name for s in children]
    assert names[0] == "radixserve.queued" and "radixserve.prefill_chunk" in names and "radixserve.decode" in names
    chunks = [s for s in children if s.name == "radixserve.prefill_chunk"]
    assert all(0 < s.attributes["radixserve.chunk_tokens"] <= 16 for s in chunks)
    assert sum(s.attributes["radixserve.chunk_tokens"] for s in chunks) == (
        root.attributes["radixserve.prompt_tokens"] - root.attributes["radixserve.cached_tokens"]
    )
    decode = next(s for s in children if s.name == "radixserve.decode")
    assert decode.attributes["radixserve.decode_steps"] == len(decode.events) == GREEDY["max_tokens"] - 1
    for s in children:
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
    untraced = [s for s in done if s.name == "radixserve.request" and s.context.trace_id != int(TRACE_ID, 16)]
    assert untraced and all(s.parent is None for s in untraced), "no traceparent: a new trace"


def test_latency_histograms(server: BackgroundServer, workload: list[dict]) -> None:
    # server-wide histograms are the admin's to read (a user key sees its own counters only)
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "radixserve_time_to_first_token_seconds",
        "radixserve_inter_token_latency_seconds",
        "radixserve_queue_time_seconds",
        "radixserve_prefill_chunk_tokens",
        "radixserve_step_time_seconds",
    ):
        fam = fams[name]
        assert fam.type == "histogram", name
        buckets = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name == name + "_bucket"]
        assert buckets[-1][0] == float("inf") and buckets[-1][1] > 0, name
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), "cumulative buckets"
        count = next(s.value for s in fam.samples if s.name == name + "_count")
        assert count == buckets[-1][1]
    chunks = {
        float(s.labels["le"]): s.value
        for s in fams["radixserve_prefill_chunk_tokens"].samples
        if s.name.endswith("_bucket")
    }
    assert chunks[16.0] == chunks[float("inf")], "chunked_prefill_size=16: no chunk is larger"
    # every metric the example Grafana dashboard charts is one the server exports
    grafana = (Path(__file__).parents[1] / "examples" / "grafana_dashboard.json").read_text()
    charted = set(re.findall(r"radixserve_[a-z_]+", grafana))
    exported = {s.name for f in fams.values() for s in f.samples}
    assert charted and charted <= exported, charted - exported


def _pool_from_metrics(server: BackgroundServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    names = ("total", "free", "evictable", "locked", "partial", "private")
    want = {f"radixserve_{n}_pages": n for n in names}
    return {want[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in want}


def _pool_from_stats(server: BackgroundServer) -> dict[str, float]:
    with client(server, ADMIN) as c:
        p = c.get("/cache/stats").json()["pool"]
    return {
        "total": p["total"],
        "free": p["free"],
        "evictable": p["cached_evictable"],
        "locked": p["locked"],
        "partial": p["partial_kept"],
        "private": p["in_flight"],
    }


def test_cache_stats_and_metrics_agree_on_every_pool_state(server: BackgroundServer, engine: Engine, workload) -> None:
    """Issue 32: after short chats at rest, kept partial pages showed as "in flight (private)" in the explorer while
    /metrics counted them as cached. Both now read one PoolStates."""
    model = engine.model_info()["model_name"]
    with client(server, ADMIN) as c:
        for i in range(3):  # three short chats of their own: each leaves its last, part-filled page kept
            msgs = [{"role": "user", "content": f"short chat number {i} about pools"}]
            assert c.post("/v1/chat/completions", json={"model": model, "messages": msgs, **GREEDY}).status_code == 200
    wait_idle(engine)
    stats, metrics = _pool_from_stats(server), _pool_from_metrics(server)
    assert stats == metrics
    assert stats["private"] == 0 and stats["partial"] > 0  # at rest; the chats' last pages are kept partial pages
    assert stats["free"] + stats["evictable"] + stats["locked"] + stats["private"] == stats["total"]
    body = {
        "model": model,
        "prompt": "a long answer please " * 8,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    samples = []
    with client(server, ADMIN) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):  # under load, sampled while the answer streams
            if i % 100 == 0:
                samples += [_pool_from_stats(server), _pool_from_metrics(server)]
    assert any(pool["private"] > 0 for pool in samples)
    for pool in samples:
        assert pool["free"] + pool["evictable"] + pool["locked"] + pool["private"] == pool["total"]
    wait_idle(engine)


def test_running_requests_table_is_per_tenant(server: BackgroundServer, engine: Engine) -> None:
    model = engine.model_info()["model_name"]
    body = {
        "model": model,
        "prompt": SECRET + " and a long answer",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with client(server, ALICE) as a, client(server, BOB) as b, a.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        s = a.get("/cache/stats").json()
        [row] = s["requests"]["running"]
        assert row["namespace"] == tenant_of(ALICE) and row["output_tokens"] >= 1
        assert row["cached_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
        assert s["pool"]["in_flight"] + s["pool"]["locked"] > 0, "the running request holds pages"
        live = [t for t in s["timelines"] if t["duration_ms"] is None]
        assert [t["rid"] for t in live] == [row["rid"]]
        other = b.get("/cache/stats").json()
        assert other["requests"]["running"] == [] and row["rid"] not in json.dumps(other)
    wait_idle(engine)


def test_otlp_endpoint_exports_over_http(engine: Engine) -> None:
    """`--otlp-endpoint`: spans reach a collector over OTLP/HTTP (a stand-in that decodes the protobuf bodies)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        app = build_app(engine, otlp_endpoint=f"http://127.0.0.1:{collector.server_port}")
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post(
                "/generate",
                json={"text": "trace me", "sampling_params": {"max_new_tokens": 3}},
                headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
            )
            assert r.status_code == 200
            app.state.tracer.flush()
        app.state.tracer.close()
    finally:
        collector.shutdown()
    assert received and {path for path, _ in received} == {"/v1/traces"}
    spans = [s for _, req in received for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    root = next(s for s in spans if s.name == "radixserve.request")
    assert root.trace_id.hex() == TRACE_ID
    assert {"radixserve.queued", "radixserve.prefill_chunk"} <= {
        s.name for s in spans if s.parent_span_id == root.span_id
    }
    service = {a.key: a.value.string_value for rs in received[0][1].resource_spans for a in rs.resource.attributes}
    assert service["service.name"] == "radixserve"


def test_event_stream_ends_when_the_server_drains(engine: Engine) -> None:
    app = build_app(engine)
    with (
        BackgroundServer(app) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("GET", "/cache/events", params={"interval_ms": 100}) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        app.state.server.draining = True  # as on SIGTERM
        rest = list(lines)  # the stream ends by itself
        assert sum(line.startswith("data: ") for line in rest) <= 2
