"""llama-server's batch-1 decode speed per thread setting, on this machine now (issue 14).

On a shared machine whose cores are oversubscribed, llama.cpp's 2-thread decode collapses (each graph step ends in a
spinning barrier that waits a whole time slice when another process holds one of the cores), which distorts any
side-by-side figure. This prints llama-server's own `timings.predicted_per_second` for one 64-token greedy answer,
twice per setting, with the load average, so a comparison run can be read against it.

    .venv/bin/python -m benchmarks.llama_threads [--settings "-t 2 -tb 2" "-t 1 -tb 1"]
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import httpx

from benchmarks.compare import engines as eng
from benchmarks.compare.__main__ import cpu_flags, default_models


def decode_rates(binary: str, gguf: str, args: list[str], log_dir: Path, repeats: int = 2) -> list[float]:
    """Start llama-server with `args` (engines.launch: up and warmed), and return its decode tok/s for `repeats`
    64-token answers."""
    port = eng.free_port()
    cmd = [binary, "-m", gguf, "-np", "1", "-c", "4096", "--port", str(port), *args]
    server = eng.launch("llama-server", cmd, port, os.cpu_count() or 1, log_dir)
    try:
        body = {"prompt": "Write a long story about a cache.", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 4}, timeout=600).raise_for_status()
        rates = []
        for _ in range(repeats):
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
            rates.append(r.raise_for_status().json()["timings"]["predicted_per_second"])
        return rates
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=["-t 2 -tb 2", "-t 2 -tb 2 --poll 0", "-t 1 -tb 1"])
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/llama_threads"), help="llama-server's logs")
    a = ap.parse_args()
    binary = eng.llama_server_binary()
    gguf, _ = default_models()
    if binary is None or gguf is None or not gguf.exists():
        raise SystemExit("needs llama-server (scripts/install_peers.sh) and the default model's GGUF")
    print(f"CPU flags: {cpu_flags()}; llama-server {binary}")
    for setting in a.settings:
        rates = decode_rates(str(binary), str(gguf), shlex.split(setting), a.log_dir)
        print(f"{setting}: decode tok/s {', '.join(f'{x:.1f}' for x in rates)}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
