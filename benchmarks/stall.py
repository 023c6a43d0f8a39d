"""What one abusive request costs everyone else (issue 12): a client streams from a live server on a small random
model while another sends a huge prompt, or thousands of stop strings; we report the stream's largest gap between
tokens with and without the abuse, and how the abusive request was answered.

    python -m benchmarks.stall [--prompt-mb 15] [--stop-strings 50000]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.gpu.common import TINY, write_random_checkpoint
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

STREAM = {
    "input_ids": [5, 6, 7, 8],
    "stream": True,
    "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
}


def stream_gaps(url: str, out: dict[str, Any]) -> None:
    """Stream one answer; record the largest gap between two events and the total time."""
    gaps, last = [], None
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/generate", json=STREAM) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    out.update(max_gap_s=max(gaps), events=len(gaps) + 1, stream_s=time.perf_counter() - start)


def run(url: str, abuse: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = threading.Thread(target=stream_gaps, args=(url, out))
    t.start()
    if abuse is not None:
        time.sleep(0.3)  # the stream is under way
        start = time.perf_counter()
        with httpx.Client(base_url=url, timeout=300) as c:
            r = c.post("/generate", json=abuse)
        out.update(
            abuse_status=r.status_code,
            abuse_answer_s=time.perf_counter() - start,
            abuse_code=(r.json().get("error") or {}).get("code") if r.status_code >= 400 else None,
        )
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-mb", type=float, default=15.0)
    ap.add_argument("--stop-strings", type=int, default=50_000)
    args = ap.parse_args()
    model = write_random_checkpoint(
        Path(tempfile.mkdtemp()) / "tiny", {**TINY, "num_hidden_layers": 4}, torch.device("cpu")
    )
    cases = {
        "no abuse": None,
        f"{args.prompt_mb:g} MB prompt": {
            "text": "fox " * int(args.prompt_mb * 2**20 / 4),
            "sampling_params": {"max_new_tokens": 1},
        },
        f"{args.stop_strings} stop strings": {
            "input_ids": [5, 6],
            "sampling_params": {"max_new_tokens": 50, "stop": [f"s{i}" for i in range(args.stop_strings)]},
        },
    }
    with (
        Engine(model=model, dtype="float32", max_total_tokens=8192) as eng,
        BackgroundServer(build_app(eng, max_body_bytes=64 << 20)) as srv,
    ):
        run(srv.url, None)  # warm-up
        rows = {name: run(srv.url, abuse) for name, abuse in cases.items()}
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
    print(
        f"machine: {platform.node()}, CPU {model_name}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {time.strftime('%Y-%m-%d')}"
    )
    print("| case | stream's largest gap s | stream s | abusive request answered | in s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        answer = "-" if "abuse_status" not in r else f"{r['abuse_status']} {r['abuse_code'] or ''}".strip()
        took = f"{r['abuse_answer_s']:.3f}" if "abuse_answer_s" in r else "-"
        print(f"| {name} | {r['max_gap_s']:.3f} | {r['stream_s']:.2f} | {answer} | {took} |")


if __name__ == "__main__":
    main()
