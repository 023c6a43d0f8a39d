"""The agent suite (benchmarks/agent_suite, issue 35): how it reads a library's exception, and one scenario per
library run against the default model. The libraries are not project dependencies: that part runs in the
interpreter `$RADIXSERVE_AGENT_SUITE_PYTHON` (scripts/agent_suite_venv.sh makes one at /tmp/agentsuitevenv) and is
skipped, with the reason, where none has them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.agent_suite.outcome import Kind, Outcome, classify
from benchmarks.agent_suite.runner import run_suite, table
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from engine_checks import engine_left_at_rest
from real_model import real_model_dir  # noqa: F401  (fixture)

# One scenario of each library: a tool round trip (or, for instructor, an extraction through a tool call).
ONE_EACH = {
    "openai/tool_round_trip_auto",
    "openai-agents/chat_model_tool_round_trip",
    "langchain-openai/bind_tools_auto",
    "langgraph/react_agent",
    "pydantic-ai/tool_round_trip",
    "instructor/tools_mode",
}
LIBRARIES = "openai, agents, langchain_openai, langgraph, pydantic_ai, instructor"


class APIStatusError(Exception):  # named as the openai SDK's, which carries the HTTP status
    def __init__(self, status_code: int) -> None:
        super().__init__(f"Error code: {status_code}")
        self.status_code = status_code


class MaxTurnsExceeded(Exception):  # named as openai-agents'
    pass


def test_an_http_error_anywhere_in_the_chain_is_the_servers() -> None:
    try:
        try:
            raise APIStatusError(500)
        except APIStatusError as inner:
            raise MaxTurnsExceeded("gave up") from inner
    except MaxTurnsExceeded as exc:
        assert classify(exc)[0] is Kind.SERVER
    assert classify(APIStatusError(400)) == (Kind.SERVER, "HTTP 400: Error code: 400")


def test_a_known_model_error_is_the_models_and_anything_else_a_protocol_error() -> None:
    assert classify(MaxTurnsExceeded("10 turns"))[0] is Kind.MODEL
    kind, detail = classify(KeyError("tool_calls"))
    assert kind is Kind.SERVER and detail.startswith("protocol: KeyError")


def test_the_table_counts_each_kind_per_library() -> None:
    outs = [Outcome("a", "x", Kind.PASSED), Outcome("a", "y", Kind.MODEL), Outcome("b", "z", Kind.TIMEOUT)]
    rows = table(outs).splitlines()
    assert rows[2] == "| a | 1 | 1 | 0 | 0 | 2 |" and rows[-1] == "| **all** | 1 | 1 | 0 | 1 | 3 |"


def _suite_python() -> str:
    exe = os.environ.get("RADIXSERVE_AGENT_SUITE_PYTHON", "/tmp/agentsuitevenv/bin/python")
    if (
        not Path(exe).exists()
        or subprocess.run([exe, "-c", "import " + LIBRARIES], capture_output=True).returncode != 0
    ):
        pytest.skip(
            f"needs {LIBRARIES}, which are not project dependencies: run scripts/agent_suite_venv.sh and set "
            "RADIXSERVE_AGENT_SUITE_PYTHON=/tmp/agentsuitevenv/bin/python"
        )
    return exe


@pytest.fixture(scope="module")
def server(real_model_dir: Path) -> Iterator[BackgroundServer]:  # noqa: F811
    # The engine `radixserve serve` runs (its dtype, weights and the publisher's sampling defaults), not the float32
    # parity engine of real_model.py: without the defaults' repetition penalty the model's turns differ.
    with engine_left_at_rest(real_model_dir, max_total_tokens=16384) as eng, BackgroundServer(build_app(eng)) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.real_model
def test_one_scenario_per_library_completes(server: BackgroundServer) -> None:
    outcomes = run_suite(_suite_python(), server.url + "/v1", timeout_s=300, jobs=2, only=ONE_EACH, verbose=False)
    assert {f"{o.library}/{o.scenario}" for o in outcomes} == ONE_EACH
    assert not [o for o in outcomes if o.kind is not Kind.PASSED], table(outcomes)
