"""Waiting on a server started as a child process (`radixserve serve`, `run_server`) until it answers /health."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, poll_s: float = 0.2) -> None:
    """Poll `url`/health until it answers 200; fail with the process's output if it exits first, or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(out.decode() if isinstance(out, bytes) else out)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not healthy within {timeout} s"
        time.sleep(poll_s)
