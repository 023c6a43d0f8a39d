"""The agent SDKs' own loops against the default model (issue 36): openai-agents with its default Responses model,
and an agent loop written as Anthropic's docs write it, each call the tool with valid arguments, send its result
back and end the turn, every exchange well formed. The SDKs are not project dependencies: they run in a separate
interpreter (tests/sdk_python.py), and these tests are skipped where none has them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from real_model import real_engine, real_model_dir  # noqa: F401  (fixtures)
from sdk_python import run_client, sdk_python

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(real_engine: Any) -> Iterator[BackgroundServer]:  # noqa: F811
    with BackgroundServer(build_app(real_engine)) as srv:
        yield srv


def test_openai_agents_sdk_completes_a_tool_round_trip(server: BackgroundServer) -> None:
    out = run_client(sdk_python("agents"), "agents_client.py", server.url, "run")
    assert out["calls"] and isinstance(out["calls"][0]["city"], str) and out["calls"][0]["city"], out
    assert out["items"][:2] == ["tool_call_item", "tool_call_output_item"], out
    assert out["items"][-1] == "message_output_item" and isinstance(out["final_output"]["sunny"], bool), out


def test_anthropic_agent_loop_completes_a_tool_round_trip(server: BackgroundServer) -> None:
    exchanges = run_client(sdk_python("anthropic"), "anthropic_client.py", server.url, "agent_loop")
    uses = [b for b in exchanges[0]["content"] if b["type"] == "tool_use"]
    assert exchanges[0]["stop_reason"] == "tool_use" and uses, exchanges[0]
    assert all(isinstance(u["input"].get("city"), str) for u in uses), uses
    assert len(exchanges) >= 2 and exchanges[-1]["stop_reason"] == "end_turn", exchanges[-1]
    for m in exchanges:  # the protocol holds on every exchange
        calls = [b for b in m["content"] if b["type"] == "tool_use"]
        assert (m["stop_reason"] == "tool_use") == bool(calls), m
