"""Run SDK clients that are not the project's dependencies (anthropic, openai-agents) in an interpreter that has
them: this one if it can import them, else `$RADIXSERVE_SDK_PYTHON` (a separate venv); the test is skipped with the
reason otherwise. The client scripts live in tests/sdk_clients/ and print one JSON document for the test to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CLIENTS = Path(__file__).parent / "sdk_clients"


def sdk_python(*modules: str) -> str:
    """An interpreter that imports `modules`, or skip."""
    for exe in (sys.executable, os.environ.get("RADIXSERVE_SDK_PYTHON")):
        if exe and subprocess.run([exe, "-c", "import " + ", ".join(modules)], capture_output=True).returncode == 0:
            return exe
    pytest.skip(
        f"needs {', '.join(modules)}, which are not project dependencies: install them in a separate venv "
        "(python3 -m venv /tmp/sdkvenv && /tmp/sdkvenv/bin/pip install anthropic openai-agents) and set "
        "RADIXSERVE_SDK_PYTHON=/tmp/sdkvenv/bin/python"
    )


def run_client(exe: str, script: str, *args: str, timeout: float = 300) -> Any:
    """Run tests/sdk_clients/<script> with args; its stdout's JSON (a failing client fails the test with its stderr)."""
    env = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONPATH": ""}
    done = subprocess.run([exe, str(CLIENTS / script), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)
