"""Where the time to first token of a cache hit goes: the cost of one step that prefills the uncached tail.

A multi-turn or RAG request whose prefix is cached still computes its tail (the new user turn or question). This
script caches a prefix, then times requests that add n new tokens to it (max_new_tokens=1, so the wall time is
one step: its prefill and the first token), fits step time = a + b * n, and profiles one step of `--profile-tokens`
new tokens, grouping torch ops into matmuls, attention and the rest. The fit is what `prefill_merge_tokens`
(radixserve/scheduler/scheduler.py) rests on: merging n more prefill tokens into a step delays every first token in
it by b * n, while running them in a step of their own costs only a.

    .venv/bin/python -m benchmarks.prefill_step_cost [--prefix 1200] [--tokens 1,16,32,64,96,128,256,512]
        [--quantization auto] [--dtype auto]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve import Engine

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {  # op name -> group, for the profile's breakdown
    "mkldnn::_linear_pointwise": "matmul (packed linear)",
    "aten::addmm": "matmul (packed linear)",
    "aten::mm": "matmul (packed linear)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
}


def step_times(eng: Engine, prefix: list[int], tokens: list[int], repeats: int, rng: random.Random) -> dict[int, float]:
    """Best wall time (s) of a request adding n fresh tokens to the cached prefix, for each n."""
    out = {}
    for n in tokens:
        times = []
        for _ in range(repeats):
            ids = prefix + [rng.randrange(1000, 20000) for _ in range(n)]
            t = time.perf_counter()
            res = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
            times.append(time.perf_counter() - t)
            assert res["meta_info"]["cached_tokens"] == len(prefix), "the prefix must come from the cache"
        out[n] = min(times)
    return out


def fit(times: dict[int, float]) -> tuple[float, float]:
    """Least-squares a, b of time = a + b * n."""
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def profile_step(eng: Engine, prefix: list[int], n: int, rng: random.Random) -> tuple[float, dict[str, float]]:
    """Wall time of the model step that prefills n new tokens, and its self CPU time (s) per op group."""
    execute = eng.runner.execute
    seen: dict[str, Any] = {}

    def profiled(batch: Any) -> Any:  # runs on the engine's loop thread, where the step's ops run
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            out = execute(batch)
            seen["wall"] = time.perf_counter() - t
        seen["prof"] = prof
        return out

    eng.runner.execute = profiled  # type: ignore[method-assign]
    try:
        eng.generate(
            input_ids=prefix + [rng.randrange(1000, 20000) for _ in range(n)], sampling_params={"max_new_tokens": 1}
        )
    finally:
        eng.runner.execute = execute  # type: ignore[method-assign]
    groups: dict[str, float] = {}
    for ev in seen["prof"].key_averages():
        group = GROUPS.get(ev.key, "everything else")
        groups[group] = groups.get(group, 0.0) + ev.self_cpu_time_total / 1e6
    return seen["wall"], groups


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1200, help="cached prefix length in tokens")
    ap.add_argument("--tokens", default="1,16,32,64,96,128,256,512", help="new-token counts to time (two or more)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-tokens", type=int, default=96)
    ap.add_argument("--quantization", default="auto", help="the weights: auto (a GGUF's own blocks), int8, ...")
    # auto, as `radixserve serve`: an explicit bfloat16 made the default model's `auto` weights dense bfloat16, not
    # the GGUF's own blocks, and left deterministic mode off (issue 38 session 49)
    ap.add_argument("--dtype", default="auto", help="activations: auto (what the CPU's kind runs), bfloat16, ...")
    args = ap.parse_args(argv)
    tokens = sorted({int(t) for t in args.tokens.split(",")})
    if len(tokens) < 2:
        ap.error("--tokens needs two or more distinct counts: the fit is a line through them")
    rng = random.Random(0)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else "n/a"
    with Engine(dtype=args.dtype, quantization=args.quantization) as eng:
        setup = f"{eng.dtype_name}, {eng.quantization} weights, deterministic {'on' if eng.deterministic else 'off'}"
        prefix = [rng.randrange(1000, 20000) for _ in range(args.prefix)]
        eng.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})
        step_times(eng, prefix, [tokens[-1]], 1, rng)  # warm-up
        times = step_times(eng, prefix, tokens, args.repeats, rng)
        a, b = fit(times)
        wall, groups = profile_step(eng, prefix, args.profile_tokens, rng)
    print(
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads. Commit: {commit}. Load average (1 min) at end: {load}."
    )
    print(f"- Command: `python -m benchmarks.prefill_step_cost {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"- Default model, {setup}, {args.prefix}-token prefix served from the cache; best of {args.repeats}.\n")
    print("| new tokens | step ms | ms per new token |\n|---|---|---|")
    for n, t in times.items():
        print(f"| {n} | {t * 1e3:.1f} | {t * 1e3 / n:.2f} |")
    print(f"\nFit: step = {a * 1e3:.1f} ms + {b * 1e3:.2f} ms x new tokens (a / b = {a / b:.0f} tokens).\n")
    total = sum(groups.values())
    print(
        f"Profile of one step with {args.profile_tokens} new tokens ({wall * 1e3:.1f} ms wall, {total * 1e3:.1f} ms of op time):\n"
    )
    print("| ops | ms | share |\n|---|---|---|")
    for group, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {t * 1e3:.1f} | {t / total:.0%} |")
    if total < wall / 2:
        print(
            f"\nThe ops cover {total / wall:.0%} of the step's wall time: its layers ran in the C++ stack "
            "(radixserve_kernels/cpu/decoder_stack.cpp, deterministic mode), which the profiler does not see into."
        )


if __name__ == "__main__":
    main()
