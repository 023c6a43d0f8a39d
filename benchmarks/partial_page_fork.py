"""Fork branches' time to first token at page 16 with partial-page reuse, without it, and at page 1, side by side.

Replays the fork workload's recorded programs (a `results_raw.json` written by `python -m benchmarks.compare
--workload fork`) on three in-process engines of the default model, program by program, rotating which engine goes
first: each program's stages run in order (the prefill call, the branches together, the merge), and every request
streams so that its first token is timed. The three engines see the same prompts in the same order, so their caches
evolve alike; one program runs at a time, on one engine at a time.

    .venv/bin/python -m benchmarks.partial_page_fork --replay benchmarks/out/.../results_raw.json [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "page 16, partial-page reuse": {"page_size": 16, "enable_partial_page_reuse": True},
    "page 16, without it": {"page_size": 16, "enable_partial_page_reuse": False},
    "page 1": {"page_size": 1},
}


def programs(path: Path) -> list[list[list[dict[str, Any]]]]:
    """The recorded fork programs: per program, its stages in order, each a list of calls (prompt, max_tokens, tag)."""
    rows = next(v for k, v in json.loads(path.read_text()).items() if k.startswith("fork/"))
    by_session: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(rows, key=lambda r: r["sent"]):
        by_session[r["session"]][r["stage"]].append(r)
    return [[stages[k] for k in sorted(stages)] for _, stages in sorted(by_session.items())]


async def timed(eng: Engine, call: dict[str, Any]) -> tuple[str, float, int, int]:
    """(tag, TTFT in ms, prompt tokens, cached tokens) of one call, streamed."""
    params = {"max_new_tokens": call["max_tokens"], "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, meta = None, {}
    async for chunk in eng.async_generate(prompt=call["prompt"], sampling_params=params, stream=True):
        if ttft is None and (chunk["output_ids"] or call["max_tokens"] == 0):
            ttft = 1e3 * (time.perf_counter() - t0)
        meta = chunk["meta_info"]
    return call["tag"], ttft or 1e3 * (time.perf_counter() - t0), meta["prompt_tokens"], meta["cached_tokens"]


async def run_program(eng: Engine, program: list[list[dict[str, Any]]]) -> list[tuple[str, float, int, int]]:
    out = []
    for stage in program:
        out += await asyncio.gather(*(timed(eng, c) for c in stage))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--replay", type=Path, required=True, help="results_raw.json of a compare run with the fork workload"
    )
    ap.add_argument("--rounds", type=int, default=2, help="times through all programs (the caches flushed between)")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit.strip()}, "
        f"{platform.processor() or platform.machine()}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads"
    )
    progs = programs(args.replay)
    engines = {name: Engine(dtype="bfloat16", max_total_tokens=args.kv_tokens, **kw) for name, kw in CONFIGS.items()}
    names = list(engines)
    results: dict[str, list[tuple[str, float, int, int]]] = {n: [] for n in names}
    try:
        for name in names:  # warm-up: one short request each
            engines[name].generate("warm up", {"max_new_tokens": 2})
        k = 0
        for rnd in range(args.rounds):
            for eng in engines.values():
                eng.flush_cache()
            for program in progs:
                order = names[k % len(names) :] + names[: k % len(names)]
                k += 1
                for name in order:
                    results[name] += asyncio.run(run_program(engines[name], program))
    finally:
        for eng in engines.values():
            eng.shutdown()
    print(f"{len(progs)} programs x {args.rounds} rounds; TTFT ms (median, p90) per tag; prompt tokens from cache")
    print("| engine | branch TTFT p50 | branch TTFT p90 | merge TTFT p50 | prefill call p50 | from cache / prompt |")
    print("|---|---|---|---|---|---|")
    for name in names:
        rows = results[name]

        def q(tag: str, p: float) -> float:
            xs = sorted(t for g, t, _, _ in rows if g == tag)
            return statistics.quantiles(xs, n=10)[int(p * 10) - 1] if p != 0.5 else statistics.median(xs)

        cached, prompt = sum(c for *_, c in rows), sum(p for *_, p, _ in rows)
        print(
            f"| {name} | {q('branch', 0.5):.0f} | {q('branch', 0.9):.0f} | {q('merge', 0.5):.0f} | "
            f"{q('prefill', 0.5):.0f} | {cached:,} / {prompt:,} ({cached / prompt:.1%}) |"
        )


if __name__ == "__main__":
    main()
