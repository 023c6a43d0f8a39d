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
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.compare import engines as eng
from benchmarks.compare.__main__ import cpu_flags, default_models


def decode_rates(binary: str, gguf: str, args: list[str], repeats: int = 2) -> list[float]:
    """Start llama-server with `args`, warm it up, and return its decode tok/s for `repeats` 64-token answers."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["LD_LIBRARY_PATH"] = str(Path(binary).parent)
    port = eng.free_port()
    cmd = [binary, "-m", gguf, "-np", "1", "-c", "4096", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {shlex.join(cmd)}")
            time.sleep(0.5)
        body = {"prompt": "Write a long story about a cache.", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body | {"max_tokens": 4}, timeout=600).raise_for_status()
        rates = []
        for _ in range(repeats):
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            rates.append(r.raise_for_status().json()["timings"]["predicted_per_second"])
        return rates
    finally:
        os.killpg(proc.pid, 15)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=["-t 2 -tb 2", "-t 2 -tb 2 --poll 0", "-t 1 -tb 1"])
    a = ap.parse_args()
    binary = eng.llama_server_binary()
    gguf, _ = default_models()
    if binary is None or gguf is None or not gguf.exists():
        raise SystemExit("needs llama-server (scripts/install_peers.sh) and the default model's GGUF")
    print(f"CPU flags: {cpu_flags()}; llama-server {binary}")
    for setting in a.settings:
        rates = decode_rates(str(binary), str(gguf), shlex.split(setting))
        print(f"{setting}: decode tok/s {', '.join(f'{x:.1f}' for x in rates)}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
