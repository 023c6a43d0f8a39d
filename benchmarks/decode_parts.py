"""Where a decode step's time goes, timed with wall clocks around each part (no profiler: at one token per step
torch.profiler's own cost per op is larger than most of the ops it times, see benchmarks/profile_step.py).

One greedy request with a random prompt of `--context` tokens, then `--tokens` decode steps; per step, the mean
milliseconds in the layers' linears (qkv, o, gate_up, down), the attention backend (plan and forward, KV writes
included), the LM head, the sampler, and the whole `execute` (the rest of it: embedding, norms, RoPE, residual adds,
SiLU, Python). Tokens/s is over the whole request, engine loop included.

    .venv/bin/python -m benchmarks.decode_parts [--context 30 1000] [--tokens 64] [--dtype auto] [--quantization auto]
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable
from typing import Any

from benchmarks.profile_step import step_parts, wrapped
from benchmarks.quant_engine import cpu_flags
from radixserve import Engine


def measure(eng: Engine, context: int, tokens: int, seed: int) -> tuple[float, dict[str, float]]:
    """(tokens/s, mean ms per step of each part) of one greedy request after a warm-up one."""
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 20000) for _ in range(context)]
    greedy = {"temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 4})
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t

        return run

    with wrapped([*step_parts(eng), (eng.runner, "execute", "execute")], timed):
        t = time.perf_counter()
        eng.generate(input_ids=ids[:-1] + [7], sampling_params={**greedy, "max_new_tokens": tokens + 1})
        wall = time.perf_counter() - t
    return tokens / wall, {k: v / (tokens + 1) * 1e3 for k, v in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, nargs="+", default=[30, 1000])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    a = ap.parse_args()
    print(cpu_flags())
    with Engine(dtype=a.dtype, quantization=a.quantization, speculative="off", max_total_tokens=4096) as eng:
        info = eng.model_info()
        print(f"dtype {info['dtype']}, weights {info['quantization']}")
        print(
            "| context | tok/s | linears ms | attention ms | lm_head ms | sampler ms | execute ms | rest of execute ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for i, context in enumerate(a.context):
            rate, ms = measure(eng, context, a.tokens, seed=i)
            parts = ("layer linears", "attention", "lm_head", "sampler")
            rest = ms["execute"] - sum(ms[p] for p in parts)
            print(
                f"| {context} | {rate:.1f} | "
                + " | ".join(f"{ms[p]:.2f}" for p in (*parts, "execute"))
                + f" | {rest:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
