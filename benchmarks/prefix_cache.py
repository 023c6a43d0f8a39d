"""Shared-prefix workload with the radix cache on and off, side by side in one run.

One 1024-token prefix, 16 requests with distinct 32-token tails, 16 new tokens each, on a random
12-layer / hidden-768 Llama-shaped model in bfloat16. Prints prefill tokens computed, wall time and their ratios.

    .venv/bin/python -m benchmarks.prefix_cache [--requests 16] [--prefix 1024]
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_model import make_random_model
from radixserve import Engine


def run(model: Path, cache: bool, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, float]:
    with Engine(model=model, dtype="bfloat16", enable_radix_cache=cache, max_total_tokens=32768) as eng:
        eng.generate(input_ids=[[5] * 32], sampling_params={"max_new_tokens": 2})  # warm-up (allocator, threads)
        eng.flush_cache()
        before = eng.metrics()["computed_prefill_tokens_total"]
        t0 = time.perf_counter()
        eng.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        )
        wall = time.perf_counter() - t0
        m = eng.metrics()
        return wall, m["computed_prefill_tokens_total"] - before, m["hit_rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(3, 32000) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(3, 32000) for _ in range(args.tail)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_model(Path(tmp) / "model")
        off = run(model, False, prompts, args.new_tokens)
        on = run(model, True, prompts, args.new_tokens)
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"workload: {args.requests} requests, {args.prefix}-token shared prefix, {args.tail}-token tails, "
        f"{args.new_tokens} new tokens, bf16, 12 layers hidden 768"
    )
    print("| cache | wall s | prefill tokens computed | hit rate |")
    print("|---|---|---|---|")
    print(f"| off | {off[0]:.2f} | {off[1]} | {off[2]:.3f} |")
    print(f"| on  | {on[0]:.2f} | {on[1]} | {on[2]:.3f} |")
    print(f"speed-up (off/on wall): {off[0] / on[0]:.2f}x; prefill tokens off/on: {off[1] / max(on[1], 1):.2f}x")


if __name__ == "__main__":
    main()
