"""Retention from the request APIs over HTTP: retention_seconds on /generate and chat, prompt_cache_retention on chat
and /v1/responses, cache_control on /v1/messages and on chat content parts, agent retention of turns that end in
tool calls (whole and streamed, on all three chat APIs; off with agent_retention=False), and the retention figures
in /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.server.agent_retention import ToolGaps
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.retention_hints import hinted

PROMPT = list(range(300, 340))
TTLS = [("a", "5m"), ("b", "1h"), ("c", None)]
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]
SCHEMA = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}
CHAT_TOOL = {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]}
CHAT_TOOL |= {"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def app(engine: Engine) -> Starlette:
    return build_app(engine)


@pytest.fixture(scope="module")
def http(app: Starlette) -> Iterator[httpx.Client]:
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def metrics(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {s.name: s.value for f in families for s in f.samples}


def retentions(http: httpx.Client) -> float:
    return metrics(http)["radixserve_retentions_total"]


def test_generate_retention_seconds_and_metrics(http: httpx.Client) -> None:
    before = retentions(http)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "retention_seconds": 60}
    assert http.post("/generate", json=body).status_code == 200
    m = metrics(http)
    assert m["radixserve_retentions_total"] == before + 1
    assert m["radixserve_retained_pages"] >= 10 and m["radixserve_retained_bytes"] > 0
    assert m["radixserve_retained_nodes"] >= 1 and m["radixserve_retained_tenants"] == 1
    bad = http.post("/generate", json={**body, "retention_seconds": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "retention_seconds"
    bad = http.post("/generate", json={**body, "retention_priority": 500})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "retention_priority"


@pytest.mark.parametrize(("value", "ok"), [("24h", True), ("in_memory", True), ("forever", False)])
def test_chat_prompt_cache_retention(http: httpx.Client, value: str, ok: bool) -> None:
    before = retentions(http)
    body = {"model": "default", "messages": USER, "max_tokens": 3, "prompt_cache_retention": value}
    r = http.post("/v1/chat/completions", json=body)
    if not ok:
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
        return
    assert r.status_code == 200 and retentions(http) == before + 1


@pytest.mark.parametrize(("ttl", "ok"), [(None, True), ("1h", True), ("10m", False)])
def test_chat_content_part_cache_control(http: httpx.Client, ttl: str | None, ok: bool) -> None:
    before = retentions(http)
    marker = {"type": "ephemeral"} | ({"ttl": ttl} if ttl else {})
    part = {"type": "text", "text": "What is the weather in Rome?", "cache_control": marker}
    body = {"model": "default", "messages": [{"role": "user", "content": [part]}], "max_tokens": 3}
    r = http.post("/v1/chat/completions", json=body)
    if not ok:
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_control"
        return
    assert r.status_code == 200 and retentions(http) == before + 1


def test_chat_cache_control_takes_the_longest_marker_after_the_explicit_fields() -> None:
    parts = [{"type": "text", "text": t, "cache_control": {"type": "ephemeral", "ttl": ttl}} for t, ttl in TTLS]
    req = msgspec.convert({"messages": [{"role": "user", "content": parts}]}, ChatCompletionRequest)
    assert hinted(req) == {"retention_seconds": 3600.0, "retention_priority": 50}
    req.prompt_cache_retention = "24h"
    assert hinted(req)["retention_seconds"] == 24 * 3600.0
    req.retention_seconds, req.retention_priority = 30.0, 90
    assert hinted(req) == {"retention_seconds": 30.0, "retention_priority": 90}


def test_responses_prompt_cache_retention(http: httpx.Client) -> None:
    before = retentions(http)
    body = {"model": "default", "input": "Name a river.", "max_output_tokens": 3, "prompt_cache_retention": "24h"}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.json()["prompt_cache_retention"] == "24h"
    assert retentions(http) == before + 1


def test_messages_cache_control_retains_and_none_does_not(http: httpx.Client) -> None:
    before = retentions(http)
    body = {"model": "default", "messages": USER, "max_tokens": 2}
    assert http.post("/v1/messages", json=body).status_code == 200
    assert retentions(http) == before, "no cache_control, no tools: plain LRU"
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert http.post("/v1/messages", json={**body, "system": system}).status_code == 200
    assert retentions(http) == before + 1


def test_agent_turn_retained_and_its_tool_gap_measured(app: Starlette, http: httpx.Client) -> None:
    before = retentions(http)
    body = {"model": "default", "messages": USER, "max_tokens": 300, "temperature": 0, **CHAT_TOOL}
    body["prompt_cache_key"] = "weather-agent"
    r = http.post("/v1/chat/completions", json=body).json()
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert retentions(http) == before + 1, "the turn ended in a tool call: its prefix is retained"
    gaps = app.state.server.tool_gaps
    assert call["id"] in gaps.pending
    turn = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    r = http.post("/v1/chat/completions", json={**body, "messages": turn, "tool_choice": "none"})
    assert r.status_code == 200 and call["id"] not in gaps.pending
    assert len(gaps.groups[ToolGaps.group("", "weather-agent")].recent) == 1


def test_streamed_agent_turns_are_retained_on_every_chat_api(http: httpx.Client) -> None:
    before = retentions(http)
    chat = {"model": "default", "messages": USER, "max_tokens": 300, "temperature": 0, "stream": True, **CHAT_TOOL}
    with http.stream("POST", "/v1/chat/completions", json=chat) as r:
        assert r.status_code == 200 and '"tool_calls"' in "".join(r.iter_lines())
    tool = {"name": "f", "input_schema": SCHEMA}
    msg = {"model": "default", "messages": USER, "max_tokens": 300, "temperature": 0, "tools": [tool]}
    msg["tool_choice"] = {"type": "tool", "name": "f"}
    assert http.post("/v1/messages", json=msg).json()["stop_reason"] == "tool_use"
    resp = {"model": "default", "input": "Weather in Paris?", "max_output_tokens": 300, "temperature": 0}
    resp |= {"tools": [{"type": "function", "name": "f", "parameters": SCHEMA}], "tool_choice": "required"}
    out = http.post("/v1/responses", json=resp).json()["output"]
    assert any(item["type"] == "function_call" for item in out), json.dumps(out)[:300]
    assert retentions(http) == before + 3


def test_no_agent_retention(engine: Engine) -> None:
    off = build_app(engine, agent_retention=False)
    with BackgroundServer(off) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        before = retentions(http)
        body = {"model": "default", "messages": USER, "max_tokens": 300, "temperature": 0, **CHAT_TOOL}
        assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
        assert retentions(http) == before and off.state.server.tool_gaps is None
