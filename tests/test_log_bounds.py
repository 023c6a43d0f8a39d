"""The log of a real `run_server` process (issue 33): whatever a client sends (grammars past the limits, one that
fails mid-generation, a 5 MB rid, a megabyte-long field name, a long URL), the log grows by a few KB per request:
client text in a log line is cut, and no failure writes its grammar."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from grammar_bombs import BOMBS, FAILS_LATER
from server_process import wait_healthy
from test_server_launch import REPO, free_port

PER_REQUEST_BYTES = 4096


def _requests() -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body) of each abusive request."""
    generate = [
        {"text": "x", "sampling_params": {"max_new_tokens": 8, BOMBS[name][0]: BOMBS[name][1]}}
        for name in ("ebnf-alternation-20000", "ebnf-right-recursion-2000", "schema-anyOf-3000")
    ]
    generate.append({"text": "x", "sampling_params": {"max_new_tokens": 8, "ebnf": FAILS_LATER}})
    generate.append({"text": "x", "rid": "r" * 5_000_000})
    generate.append({"text": "x", "k" * 1_000_000: 1})
    calls: list[tuple[str, str, dict | None]] = [("POST", "/generate", body) for body in generate]
    calls.append(("GET", "/cache/tree?path=" + "f" * 12_000, None))
    calls.append(("GET", "/nothing/" + "p" * 12_000, None))
    return calls


@pytest.mark.slow
def test_log_grows_by_a_few_kb_per_request(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = tiny_model_factory("qwen2")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = (
        "from radixserve.server.launch import run_server\n"
        f"run_server({{'model': {str(model_dir)!r}, 'dtype': 'float32'}}, port={port})\n"
    )
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, timeout=90, poll_s=0.2)
        start = log.stat().st_size
        calls = _requests() * 2
        with httpx.Client(base_url=url, timeout=120) as c:
            for method, path, body in calls:
                status = c.request(method, path, json=body).status_code
                assert status in (400, 404), (path, status)
        grown = log.stat().st_size - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    text = log.read_text(errors="replace")
    assert grown / len(calls) < PER_REQUEST_BYTES, text[-3000:]
    assert "refused token" in text  # the grammar that failed mid-generation is logged, in one short line
