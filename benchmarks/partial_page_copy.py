"""What partial-page reuse (issue 19) costs and saves per request.

1. The copy alone: `KVPool.copy_slots` on a pool shaped like the default model's (24 layers, 2 KV heads of 64, bf16),
   for one request copying n rows and for a step of 8 such requests.
2. End to end on the default model: an owner request caches a prefix of `pages` full pages + r tokens (its partial
   page is kept); a reader then sends that prefix + `new` fresh tokens with max_new_tokens=1, so its time to first
   token is one step. Two engines, feature on and off, measured alternately with fresh prompts every trial.

    .venv/bin/python -m benchmarks.partial_page_copy [--trials 8] [--pages 4] [--new 8] [--skip-engine]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from radixserve.cache.kv_pool import KVPool

ROOT = Path(__file__).resolve().parent.parent


def copy_cost_us(rows: int, requests: int, repeats: int, geometry: tuple[int, int, int], ps: int = 16) -> float:
    """Median microseconds of one copy_slots call moving `rows` rows for each of `requests` requests."""
    layers, kv_heads, head_dim = geometry
    pool = KVPool(layers, 1 + 2 * requests + 64, ps, kv_heads, head_dim, torch.bfloat16)
    src = torch.tensor([(1 + i) * ps + r for i in range(requests) for r in range(rows)], dtype=torch.int64)
    dst = torch.tensor([(1 + requests + i) * ps + r for i in range(requests) for r in range(rows)], dtype=torch.int64)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.copy_slots(src, dst)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times[repeats // 5 :])


def default_geometry() -> tuple[int, int, int]:
    try:
        from radixserve.model.resolve import DEFAULT_GGUF_NAME, default_cache_dir

        cfg = json.loads(
            (default_cache_dir() / DEFAULT_GGUF_NAME.removesuffix("-q4_k_m.gguf") / "config.json").read_text()
        )
        return (
            cfg["num_hidden_layers"],
            cfg["num_key_value_heads"],
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        )
    except (OSError, KeyError, ImportError):
        return (24, 2, 64)  # Qwen2.5-Coder-0.5B


def engine_ttft(args: argparse.Namespace) -> dict[str, list[float]]:
    from radixserve import Engine

    engines = {
        on: Engine(dtype="bfloat16", page_size=16, max_total_tokens=8192, enable_partial_page_reuse=on)
        for on in (True, False)
    }
    rng = random.Random(0)
    vocab = 20000
    times: dict[str, list[float]] = {"on": [], "off": []}
    cached: dict[str, list[int]] = {"on": [], "off": []}
    try:
        for trial in range(args.trials + 1):  # trial 0 warms both up
            for on in (True, False) if trial % 2 else (False, True):
                eng = engines[on]
                prefix = [rng.randrange(100, vocab) for _ in range(16 * args.pages + args.rest)]
                eng.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1, "temperature": 0})
                ids = prefix + [rng.randrange(100, vocab) for _ in range(args.new)]
                t0 = time.perf_counter()
                out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
                dt = time.perf_counter() - t0
                if trial:
                    times["on" if on else "off"].append(1e3 * dt)
                    cached["on" if on else "off"].append(out["meta_info"]["cached_tokens"])
        print(f"cached tokens per reader: on {sorted(set(cached['on']))}, off {sorted(set(cached['off']))}")
    finally:
        for eng in engines.values():
            eng.shutdown()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--pages", type=int, default=4, help="full pages of the cached prefix")
    ap.add_argument("--rest", type=int, default=15, help="tokens of the prefix in its partial page (1..15)")
    ap.add_argument("--new", type=int, default=8, help="fresh tokens each reader adds")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit.strip()}, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    geometry = default_geometry()
    print(f"copy_slots on a pool of {geometry[0]} layers x {geometry[1]} KV heads x {geometry[2]}, bf16, page 16:")
    print("| rows per request | requests | us per call | us per request |")
    print("|---|---|---|---|")
    for rows in (1, 8, 15):
        for requests in (1, 8):
            us = copy_cost_us(rows, requests, args.repeats, geometry)
            print(f"| {rows} | {requests} | {us:.0f} | {us / requests:.0f} |")
    if args.skip_engine:
        return
    times = engine_ttft(args)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"reader TTFT (prefix {args.pages} pages + {args.rest}, {args.new} new tokens), median of {args.trials}: "
        f"on {on:.1f} ms, off {off:.1f} ms, on/off {on / off:.2f}"
    )
    print("  on:  " + ", ".join(f"{t:.0f}" for t in times["on"]))
    print("  off: " + ", ".join(f"{t:.0f}" for t in times["off"]))


if __name__ == "__main__":
    main()
