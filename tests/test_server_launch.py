"""`run_server` in a real process: SIGTERM stops admitting, lets running requests finish within the grace period,
cuts the ones that cannot, and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_process import wait_healthy

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_events(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Collect SSE payloads into `out`; a broken connection ends the list with the exception."""
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        out.append(exc)
    started.set()


@pytest.mark.slow
def test_sigterm_drains_and_exits_zero(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("qwen2", max_position_embeddings=8192)  # room for a request the grace cannot finish
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = (
        "from radixserve.server.launch import run_server\n"
        f"run_server({{'model': {str(model_dir)!r}, 'dtype': 'float32', 'page_size': 4, "
        f"'speculative': 'off'}}, port={port}, "
        f"grace_period_s={GRACE_S})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, timeout=90, poll_s=0.2)

        short = {
            "prompt": "The quick brown fox",
            "max_tokens": 60,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        # cannot finish within the grace period (speculation is off: a tiny model's repetitive greedy answer would
        # accept long drafts and finish 8,000 tokens in seconds)
        endless = {**short, "max_tokens": 8000}
        results: list[list] = [[], []]
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=stream_events, args=(url, body, out, ev))
            for body, out, ev in zip((short, endless), results, started)
        ]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # the listener is closed: nothing new is admitted
            httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
        assert proc.wait(timeout=GRACE_S + 30) == 0
        for t in threads:
            t.join(timeout=30)

        finished, cut = results
        assert finished[-1] == "[DONE]", finished[-3:]  # the running request finished during the drain
        assert json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in finished[:-1] if json.loads(e)["choices"])
        assert cut[-1] != "[DONE]", cut[-3:]  # the one that could not finish was cut at the end of the grace period
        printed = proc.stdout.read().decode()  # type: ignore[union-attr]
        for field in ("model", "dtype / device", "KV pool", "context", "sampling defaults", "URL", "API key"):
            assert f"  {field} " in printed, printed[:2000]  # the start-up summary
        assert f"ready: serving on {url}" in printed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
