"""`radixserve serve --dp 2`: two replica processes behind the cache-aware router, one command, driven by the openai
SDK; a conversation stays on one replica and its later turns hit that replica's cache; SIGTERM stops all of it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from server_process import wait_healthy
from radixserve.router.proxy import WORKER_HEADER
from radixserve.router.replicas import replica_argv


def _free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 free (checked once; the test fails loudly if another process takes one meanwhile)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free block of ports")


def test_replica_argv_drops_the_front_options() -> None:
    argv = [
        "serve",
        "--dp",
        "2",
        "--port=9000",
        "--model",
        "m",
        "--page-size",
        "4",
        "--router-policy",
        "round_robin",
        "--host",
        "0.0.0.0",
        "--api-key",
        "k",
    ]
    assert replica_argv(argv) == ["serve", "--page-size", "4", "--api-key", "k"]


def test_serve_dp_two_replicas_behind_the_router(tiny_model_dir: Path) -> None:
    port = _free_port_block(3)
    cmd = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--dp",
        "2",
        "--port",
        str(port),
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--page-size",
        "4",
        "--max-total-tokens",
        "4096",
    ]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=240, poll_s=0.5)
        workers = httpx.get(url + "/workers").json()
        assert len(workers["workers"]) == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Hi there!"}]
        homes, cached = set(), []
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="default", messages=messages, max_tokens=6, temperature=0
            )
            r = raw.parse()
            homes.add(raw.headers[WORKER_HEADER])
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "And?"},
            ]
        assert len(homes) == 1  # the conversation stayed where its KV lives
        assert cached[1] > 0 and cached[2] > cached[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
