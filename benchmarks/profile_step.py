"""Where one CPU step's time goes on the default model, per weight format: a decode step (1 stream, ~1,000 tokens of
context) and a step that prefills 96 new tokens after a cached 1,000-token prefix (issue 14).

Each part is timed with torch.profiler `record_function` labels put around it for the profiled step only:
the layers' projections (qkv, o, gate_up, down: int8/int4/bf16 linears), the attention backend (its plan and its
per-layer forward, KV writes included), the LM head (hidden -> logits over the 152k vocabulary), the sampler; the
rest of the step's wall time is the embedding, norms, RoPE, residual adds, SiLU and Python/dispatch overhead.

    .venv/bin/python -m benchmarks.profile_step [--configs bfloat16:none bfloat16:int8 bfloat16:int4] [--top 12]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import contextlib  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import radixserve.model.llama as llama_mod  # noqa: E402
import radixserve.model.runner as runner_mod  # noqa: E402
from benchmarks.quant_engine import cpu_flags  # noqa: E402
from radixserve import Engine  # noqa: E402

# "layer stack": the layers as one C++ call (radixserve/model/cpu_stack.py: a GGUF model on CPU), linears, attention,
# norms and the rest of each layer inside it
PARTS = ("layer linears", "layer stack", "attention", "lm_head", "sampler")
PREFIX = 1000


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return run


def step_parts(eng: Engine) -> list[tuple[Any, str, str]]:
    """(object, method name, part) for every timed part of a step, the sampler (a module function) last."""
    model, attn = eng.runner.model, eng.runner.attn
    parts = [
        (mod, "forward", "layer linears")
        for layer in model.layers
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    parts += [(attn, "forward", "attention"), (attn, "plan", "attention"), (model, "compute_logits", "lm_head")]
    parts.append((llama_mod, "run_stack", "layer stack"))
    return [*parts, (runner_mod, "sample_ids", "sampler")]


@contextlib.contextmanager
def wrapped(targets: list[tuple[Any, str, str]], wrap: Callable[[str, Callable[..., Any]], Any]) -> Iterator[None]:
    """Replace each target's method by wrap(part, method) for the duration; restored on exit."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, label in targets:
        setattr(obj, name, wrap(label, getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, before in reversed(saved):
            if isinstance(obj, types.ModuleType):
                setattr(obj, name, before)
            else:
                delattr(obj, name)  # the instance attribute; the class's method shows again


def labels(eng: Engine) -> contextlib.AbstractContextManager[None]:
    """Wrap the step's parts in record_function labels; restored on exit."""
    return wrapped(step_parts(eng), _labelled)


def profile_call(eng: Engine, ids: list[int], new_tokens: int, which: int) -> tuple[float, Any]:
    """Profile the `which`-th model step of one request (0: its prefill; 1, 2...: decode steps)."""
    execute = eng.runner.execute
    seen: dict[str, Any] = {"n": 0}

    def maybe_profiled(step: Any) -> Any:  # runs on the engine's loop thread, where the step's ops run
        seen["n"] += 1
        if seen["n"] - 1 != which:
            return execute(step)
        with labels(eng), profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            out = execute(step)
            out.wait()
            seen["wall"] = time.perf_counter() - t
        seen["prof"] = prof
        return out

    eng.runner.execute = maybe_profiled  # type: ignore[method-assign]
    try:
        eng.generate(
            input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        )
    finally:
        eng.runner.execute = execute  # type: ignore[method-assign]
    return seen["wall"], seen["prof"]


def breakdown(wall: float, prof: Any, top: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    avg = prof.key_averages()
    parts = {p: next((e.cpu_time_total / 1e6 for e in avg if e.key == p), 0.0) for p in PARTS}
    parts["rest (norms, RoPE, adds, embedding, Python)"] = max(0.0, wall - sum(parts.values()))
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in avg if e.key not in PARTS), key=lambda kv: -kv[1])
    return parts, ops[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["bfloat16:none", "bfloat16:int8", "bfloat16:int4"])
    ap.add_argument("--tail", type=int, default=96)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    print(cpu_flags())
    rng = random.Random(0)
    for conf in a.configs:
        dtype, quant = conf.split(":")
        with Engine(dtype=dtype, quantization=quant, max_total_tokens=4096) as eng:
            prefix = [rng.randrange(1000, 20000) for _ in range(PREFIX)]
            eng.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})  # cache the prefix, warm up
            tail = [rng.randrange(1000, 20000) for _ in range(a.tail)]
            steps = {
                f"decode, 1 stream, {PREFIX + 3} context": profile_call(eng, prefix + tail[:1], 4, 3),
                f"prefill of {a.tail} new tokens after a cached {PREFIX}": profile_call(eng, prefix + tail, 1, 0),
            }
        for what, (wall, prof) in steps.items():
            parts, ops = breakdown(wall, prof, a.top)
            print(f"\n{conf}, {what}: {wall * 1e3:.1f} ms wall\n\n| part | ms | share |\n|---|---|---|")
            for p, t in parts.items():
                print(f"| {p} | {t * 1e3:.1f} | {t / wall:.0%} |")
            print("\ntop ops by self time: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in ops), flush=True)


if __name__ == "__main__":
    main()
