"""SGLang's real frontend client (`sgl.RuntimeEndpoint`) against radixserve (issue 34): every program of
tests/sglang_style_programs.py passes, streaming included, and `sgl.get_server_info()` answers.

SGLang's frontend lives in its own venv (it pins torch and much else; never the project's): the interpreter is
$RADIXSERVE_SGLANG_PYTHON, else /tmp/sglvenv/bin/python, set up by scripts/sglang_client_venv.sh. Where it is
missing or cannot import sglang, these tests skip with the reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from radixserve.server.background import BackgroundServer
from server_fixtures import engine, server  # noqa: F401  (fixtures)
from sglang_style_programs import PROGRAMS

PROGRAMS_FILE = Path(__file__).with_name("sglang_style_programs.py")
SGLANG_PYTHON = os.environ.get("RADIXSERVE_SGLANG_PYTHON", "/tmp/sglvenv/bin/python")


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The client venv's interpreter (checked before the server starts, so a skip costs nothing)."""
    if not Path(SGLANG_PYTHON).exists():
        pytest.skip(f"no SGLang client venv at {SGLANG_PYTHON} (scripts/sglang_client_venv.sh makes one)")
    probe = subprocess.run(
        [SGLANG_PYTHON, "-c", "import sglang; sglang.RuntimeEndpoint"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        pytest.skip(f"{SGLANG_PYTHON} cannot import sglang's frontend: {probe.stderr.strip().splitlines()[-1:]}")
    return SGLANG_PYTHON


@pytest.fixture(scope="module")
def results(sglang_python: str, server: BackgroundServer) -> dict[str, str]:  # noqa: F811
    done = subprocess.run(
        [sglang_python, str(PROGRAMS_FILE), server.url, "sglang"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_under_sglangs_client(results: dict[str, str], name: str) -> None:
    assert results[name] == "ok", results[name]
