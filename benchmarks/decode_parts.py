"""Where a decode step's time goes, timed with wall clocks around each part (no profiler: at one token per step
torch.profiler's own cost per op is larger than most of the ops it times, see benchmarks/profile_step.py).

One greedy request (`--streams N`: N at once, a step then holds N rows) with a random prompt of `--context` tokens,
then `--tokens` decode steps; per step, the mean milliseconds in the layers' linears (qkv, o, gate_up, down), the
attention backend (plan and forward, KV writes included), the LM head, the sampler, and the whole `execute` (the
rest of it: embedding, norms, RoPE, residual adds, SiLU, Python). Tokens/s is over the whole request (all streams),
engine loop included. A GGUF model on CPU runs its layers as one C++ call a step (radixserve/model/cpu_stack.py):
then "layer stack" holds the layers' linears, attention, norms and glue, and "rest" what is left around them;
`--no-stack` times the Python layers part by part instead.

Against the floor: the bytes a decode step must read (the layers' weights and the LM head's, as the model holds
them: int8 codes, the GGUF's blocks, bfloat16...) over this machine's read bandwidth (measured first: the best of a
few passes over a buffer larger than the caches, all threads; or `--bandwidth`), and the linears' and LM head's time as a multiple of
their floor (1.0: memory-bound).

    .venv/bin/python -m benchmarks.decode_parts [--context 30 1000] [--tokens 64] [--dtype auto] [--quantization auto]
        [--no-stack] [--streams 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import radixserve.model.cpu_stack as cpu_stack
from benchmarks.profile_step import step_parts, wrapped
from benchmarks.quant_engine import cpu_flags
from radixserve import Engine


def measure(eng: Engine, context: int, tokens: int, seed: int, streams: int = 1) -> tuple[float, dict[str, float]]:
    """(tokens/s over all streams, mean ms per step of each part) of `streams` greedy requests decoding together
    (one batch, every step a row each) after a warm-up of the same prompts."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(context)] for _ in range(streams)]
    greedy = {"temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 4})
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t

        return run

    stack = eng.runner.model.cpu_stack
    if stack is not None:
        stack.take_times()  # zeroed: the warm-up's are not counted
    with wrapped([*step_parts(eng), (eng.runner, "execute", "execute")], timed):
        t = time.perf_counter()
        eng.generate(
            input_ids=[ids[:-1] + [7] for ids in prompts], sampling_params={**greedy, "max_new_tokens": tokens + 1}
        )
        wall = time.perf_counter() - t
    if stack is not None:  # the stack's own clocks, part by part: "stack: <part>"
        totals.update({f"stack: {k}": v for k, v in stack.take_times().items()})
    return streams * tokens / wall, {k: v / (tokens + 1) * 1e3 for k, v in totals.items()}


def module_bytes(mods: list[nn.Module]) -> int:
    """Bytes of the tensors the modules hold (each counted once: a tied head shares the embedding's)."""
    seen = {id(t): t for m in mods for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def step_bytes(eng: Engine) -> tuple[int, int]:
    """(bytes of the layers' linears, bytes of the LM head) a decode step reads."""
    model = eng.runner.model
    linears = [
        mod
        for layer in model.layers
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    head = model.lm_head if model.lm_head is not None else model.tied_head
    if head is None:  # logits straight from the embedding's rows
        return module_bytes(linears), model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return module_bytes(linears), module_bytes([head])


def read_bandwidth(gb: float = 0.5, passes: int = 5) -> float:
    """Bytes/s of the best of `passes` sums over `gb` GB of float32 (past every cache), torch's threads: of torch's
    reductions tried (amax, sum of float32, int64, bfloat16) the fastest per byte. A loaded machine shows less."""
    buf = torch.ones(int(gb * 1e9) // 4)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, nargs="+", default=[30, 1000])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--bandwidth", type=float, help="GB/s to take as the floor's bandwidth instead of measuring it")
    ap.add_argument("--no-stack", action="store_true", help="the Python layers, not the C++ stack")
    ap.add_argument("--streams", type=int, default=1, help="requests decoding together (a step's rows)")
    a = ap.parse_args()
    cpu_stack.ENABLED = not a.no_stack
    print(cpu_flags(), f"load={os.getloadavg()[0]:.1f}")
    bandwidth = a.bandwidth * 1e9 if a.bandwidth else read_bandwidth()
    # Room for every stream's prompt and tokens at once: with less, the streams' cached prompts evicted each other
    # and the measured run prefilled them again (8 streams x 1,000 tokens in a 4,096-token pool)
    room = max(4096, a.streams * (max(a.context) + a.tokens + 64))
    with Engine(dtype=a.dtype, quantization=a.quantization, speculative="off", max_total_tokens=room) as eng:
        mover = getattr(eng.runner.model, "huge_pages", None)
        if mover is not None:
            mover.join()  # the steady state: a GGUF's blocks on huge pages (radixserve/gguf/huge_pages.py)
        info = eng.model_info()
        lin_bytes, head_bytes = step_bytes(eng)
        lin_floor = lin_bytes / bandwidth * 1e3
        floor = {"layer linears": lin_floor, "layer stack": lin_floor, "lm_head": head_bytes / bandwidth * 1e3}
        print(
            f"dtype {info['dtype']}, weights {info['quantization']}; read bandwidth {bandwidth / 1e9:.1f} GB/s; a step "
            f"reads {lin_bytes / 1e6:.0f} MB of linears (floor {floor['layer linears']:.2f} ms) and "
            f"{head_bytes / 1e6:.0f} MB of LM head (floor {floor['lm_head']:.2f} ms): "
            f"{1e3 / (floor['layer linears'] + floor['lm_head']):.0f} tok/s at most"
        )
        print(
            "| context | tok/s | linears ms (x floor) | layer stack ms (x linears' floor) | attention ms "
            "| lm_head ms (x floor) | sampler ms | execute ms | rest of execute ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for i, context in enumerate(a.context):
            rate, ms = measure(eng, context, a.tokens, seed=i, streams=a.streams)
            parts = ("layer linears", "layer stack", "attention", "lm_head", "sampler")
            rest = ms["execute"] - sum(ms.get(p, 0.0) for p in parts)
            cells = [
                f"{ms.get(p, 0.0):.2f}" + (f" ({ms.get(p, 0.0) / floor[p]:.1f}x)" if p in floor else "")
                for p in (*parts, "execute")
            ]
            print(f"| {context} | {rate:.1f} | " + " | ".join(cells) + f" | {rest:.2f} |", flush=True)
            inside = {k.removeprefix("stack: "): v for k, v in ms.items() if k.startswith("stack: ")}
            if any(inside.values()):
                print("  inside the stack, ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in inside.items()))
        print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
