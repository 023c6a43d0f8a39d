"""/v1/messages and /v1/messages/count_tokens on the tiny model: the official anthropic SDK (create, stream, a
tool_use / tool_result round trip, an agent loop, count_tokens, cache reads on the second turn; run in an
interpreter that has the SDK, see tests/sdk_python.py), the raw event sequence, `x-api-key`, and bad input as 4xx
in Anthropic's error envelope."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from sdk_python import run_client, sdk_python
from server_fixtures import engine, http, server  # noqa: F401  (fixtures)

USER = [{"role": "user", "content": "Name a fast fox."}]


@pytest.fixture(scope="module")
def anthropic_python() -> str:
    return sdk_python("anthropic")


def sdk(exe: str, server: BackgroundServer, scenario: str) -> Any:
    return run_client(exe, "anthropic_client.py", server.url, scenario)


def test_sdk_create(anthropic_python: str, server: BackgroundServer) -> None:
    m = sdk(anthropic_python, server, "create")
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"][0]["type"] == "text" and m["stop_reason"] in ("max_tokens", "end_turn", "stop_sequence")
    u = m["usage"]
    assert u["output_tokens"] == 6 or m["stop_reason"] != "max_tokens"
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] > 0


def test_sdk_stream(anthropic_python: str, server: BackgroundServer) -> None:
    out = sdk(anthropic_python, server, "stream")
    events = [e for e in out["events"] if e != "ping"]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and "content_block_delta" in events and "content_block_stop" in events
    final = out["final"]
    assert final["stop_reason"] == "max_tokens" and final["usage"]["output_tokens"] == 6
    assert final["content"][0]["text"]


@pytest.mark.parametrize("scenario", ["tools", "tools_stream"])
def test_sdk_tool_use_round_trip(anthropic_python: str, server: BackgroundServer, scenario: str) -> None:
    out = sdk(anthropic_python, server, scenario)
    first, final = out["first"], out["final"]
    assert first["stop_reason"] == "tool_use"
    [use] = [b for b in first["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["id"] and set(use["input"]) == {"city", "unit"}
    assert final["stop_reason"] in ("end_turn", "max_tokens") and all(b["type"] == "text" for b in final["content"])


def test_sdk_agent_loop_keeps_the_protocol(anthropic_python: str, server: BackgroundServer) -> None:
    exchanges = sdk(anthropic_python, server, "agent_loop")
    assert exchanges[0]["stop_reason"] == "tool_use" and len(exchanges) >= 2
    for m in exchanges:  # every exchange is a well-formed message, whatever the random model says
        uses = [b for b in m["content"] if b["type"] == "tool_use"]
        assert (m["stop_reason"] == "tool_use") == bool(uses), m
        assert all(isinstance(b["input"], dict) and b["id"] for b in uses)


def test_sdk_count_tokens_is_our_tokenizers_count(
    anthropic_python: str, server: BackgroundServer, engine: Engine
) -> None:
    out = sdk(anthropic_python, server, "count")
    messages = [{"role": "system", "content": "You are terse."}, *USER]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out["input_tokens"] == len(engine.tokenizer.encode(text, add_special_tokens=False))


def test_sdk_second_turn_reads_the_cache(anthropic_python: str, server: BackgroundServer) -> None:
    out = sdk(anthropic_python, server, "cache")
    first, second = out["first"], out["second"]
    assert first["cache_creation_input_tokens"] > 0
    assert second["cache_read_input_tokens"] > 0
    whole = sum(first[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    assert second["cache_read_input_tokens"] >= whole - 4  # the whole first prompt, to within a page
    assert first["cache_creation"]["ephemeral_5m_input_tokens"] == first["cache_creation_input_tokens"]


def test_cache_control_ttl_is_reported_where_the_writes_go(http: httpx.Client) -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": "You answer questions about rivers, briefly.", "cache_control": hour}]
    body = {"model": "default", "system": system, "messages": USER, "max_tokens": 2}
    u = http.post("/v1/messages", json=body).json()["usage"]
    assert u["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0,
        "ephemeral_1h_input_tokens": u["cache_creation_input_tokens"],
    }
    assert u["cache_creation_input_tokens"] > 0


def test_sdk_errors_are_anthropic_exceptions(anthropic_python: str, server: BackgroundServer) -> None:
    for err in sdk(anthropic_python, server, "errors"):
        assert err["class"] == "BadRequestError" and err["status"] == 400, err
        assert err["body"]["type"] == "error" and err["body"]["error"]["type"] == "invalid_request_error"


def _events(r: httpx.Response) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name
            out.append((name, data))
    return out


def test_stream_with_a_tool_call_sends_input_json_delta(http: httpx.Client) -> None:
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}
    body = {"model": "default", "messages": USER, "max_tokens": 60, "stream": True}
    body |= {"tools": [tool], "tool_choice": {"type": "tool", "name": "f"}, "temperature": 0}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = _events(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for k, d in events if k == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "f"
    args = "".join(
        d["delta"]["partial_json"] for k, d in events if d.get("delta", {}).get("type") == "input_json_delta"
    )
    assert json.loads(args)["x"] in (1, 2)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.fixture(scope="module")
def keyed(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine, api_key="sk-one")) as srv:
        yield srv


def test_x_api_key_is_accepted_beside_bearer(keyed: BackgroundServer) -> None:
    body = {"model": "default", "messages": USER, "max_tokens": 2}
    for headers in ({"x-api-key": "sk-one"}, {"Authorization": "Bearer sk-one"}):
        assert httpx.post(keyed.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    r = httpx.post(keyed.url + "/v1/messages", json=body, headers={"x-api-key": "sk-two"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


SAMPLING = ("max_tokens", "top_k", "temperature")
BAD = [
    ({"messages": USER}, "max_tokens"),
    ({"messages": USER, "max_tokens": 4, "bogus": 1}, "bogus"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 4}, "tool_use_id"),
    ({"messages": USER, "max_tokens": 4, "system": [{"type": "image"}]}, "system.0.type"),
    ({"messages": USER, "max_tokens": 4, "tools": [{"name": "b", "type": "bash_20250124"}]}, "tools.0.type"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": USER, "max_tokens": 4, "top_k": -5}, "top_k"),
    ({"messages": USER, "max_tokens": 4, "cache_control": {"type": "ephemeral", "ttl": "2d"}}, "cache_control"),
    ({"messages": USER, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": USER, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": USER, "max_tokens": 4, "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("body,names", BAD)
def test_bad_input_is_a_4xx_in_anthropic_shape(http: httpx.Client, body: dict, names: str) -> None:
    for stream in (False, True):
        r = http.post("/v1/messages", json={"model": "default", **body, "stream": stream})
        assert 400 <= r.status_code < 500, r.text
        out = r.json()
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error", out
        assert names in out["error"]["message"], out
    if names not in SAMPLING:  # count_tokens takes only the prompt's fields
        r = http.post("/v1/messages/count_tokens", json={"model": "default", **body})
        assert 400 <= r.status_code < 500 and r.json()["type"] == "error", r.text


def test_unknown_model_and_malformed_json(http: httpx.Client) -> None:
    r = http.post("/v1/messages", json={"model": "other", "messages": USER, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_readme_agent_api_snippets_answer(server: BackgroundServer) -> None:
    """The README's `shell` snippets (its section on these APIs) run as written against a live server."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    [snippet] = re.findall(r"^```shell\n(.*?)^```", readme, re.S | re.M)
    done = subprocess.run(
        ["bash", "-c", snippet.replace("http://127.0.0.1:30000", server.url)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    decoder, text, answers = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].strip()
    response, message = answers
    # What the tiny random model samples varies (it may end at once): the shapes are what the snippets show.
    assert response["object"] == "response" and response["status"] in ("completed", "incomplete"), response
    if response["status"] == "incomplete":  # 16 tokens may run out
        assert response["incomplete_details"]["reason"] == "max_output_tokens", response
    assert response["usage"]["output_tokens"] >= 1, response
    messages = [item for item in response["output"] if item["type"] == "message"]
    assert all(part["type"] == "output_text" for item in messages for part in item["content"]), response
    assert message["type"] == "message" and message["stop_reason"] in ("end_turn", "max_tokens"), message
    assert message["usage"]["output_tokens"] >= 1, message
    assert all(block["type"] in ("text", "thinking") for block in message["content"]), message
