"""Per-layer cost of CPU decode attention: TorchAttentionBackend.forward (store the new K/V, then attend) with the
fused C++ op (radixserve_kernels/cpu/decode_attention.cpp) vs the SDPA path (gather the pages, then SDPA), interleaved.

The default model's shape (Qwen2.5-0.5B: 14 query heads, 2 KV heads, head_dim 64, bfloat16, page size 16), one or
more requests at each context length; `plan` (once per step, shared by all layers) is timed beside it.

`--engine`: the whole decode step instead. One Engine (the default model, bf16, no quantization, no speculation),
greedy generation of `--new-tokens` after a random `--prompt`-token prompt, decode tokens/s (after the first token)
with the op and without it (TorchAttentionBackend.use_cpu_kernels, the attention half of RADIXSERVE_CPU_KERNELS=0),
alternating A, B, A, B, and the time spent in TorchAttentionBackend.forward per decode step (all 24 layers: the KV
store and the attention, with the pages cold as a real step leaves them). bfloat16 greedy tokens of a random prompt
may part after a few tokens (near-ties; the op is the more exact of the two): "same tokens" is reported, not required.

    .venv/bin/python -m benchmarks.cpu_decode_attention [--contexts 30 1000] [--requests 1] [--iters 200]
    .venv/bin/python -m benchmarks.cpu_decode_attention --engine [--prompt 1000] [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from radixserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def setup(context: int, requests: int, page_size: int, dtype: torch.dtype) -> tuple[KVPool, ForwardBatch]:
    """A one-layer pool filled with random K/V, and a decode batch whose requests are at `context` tokens."""
    per = (context + page_size - 1) // page_size
    pool = KVPool(1, 1 + per * requests, page_size, KV_HEADS, HEAD_DIM, dtype)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape))
    pages = torch.randperm(per * requests) + 1  # scattered pages, as a busy pool hands them out
    tables = [pages[r * per : (r + 1) * per].tolist() for r in range(requests)]
    batch = ForwardBatch.build([[0]] * requests, [context - 1] * requests, tables, page_size, [])
    return pool, batch


def engine(prompt_len: int, new_tokens: int, rounds: int) -> None:
    import random

    from radixserve import Engine

    spent = [0.0, 0, False]  # seconds in forward in decode steps, decode steps, whether this step decodes
    forward, plan = TorchAttentionBackend.forward, TorchAttentionBackend.plan

    def timed_forward(self: TorchAttentionBackend, *args: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = forward(self, *args)
        if spent[2]:
            spent[0] += time.perf_counter() - t
        return out

    def counted_plan(self: TorchAttentionBackend, batch: ForwardBatch) -> None:
        spent[1] += batch.is_decode
        spent[2] = batch.is_decode
        plan(self, batch)

    TorchAttentionBackend.forward, TorchAttentionBackend.plan = timed_forward, counted_plan
    eng = Engine(dtype="auto", quantization="none", max_total_tokens=4096, speculative="off")
    try:
        rng = random.Random(0)
        vocab = eng.runner.config.vocab_size
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)]
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        rates: dict[str, list[float]] = {"op": [], "sdpa": []}
        attn: dict[str, list[float]] = {"op": [], "sdpa": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(rounds):
            for name in rates:
                TorchAttentionBackend.use_cpu_kernels = name == "op"
                eng.flush_cache()
                spent[:] = [0.0, 0, False]
                out = eng.generate(input_ids=prompt, sampling_params=params)
                meta = out["meta_info"]  # as benchmarks/cpu_speed.py: tokens after the first / time after it
                rates[name].append((meta["completion_tokens"] - 1) / (meta["e2e_latency"] - meta["ttft"]))
                tokens[name] = out["output_ids"]
                attn[name].append(spent[0] / max(spent[1], 1) * 1e3)
                print(
                    f"{name}: {rates[name][-1]:.2f} tok/s, attention {attn[name][-1]:.2f} ms/step"
                    f" (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
        med = {name: statistics.median(r) for name, r in rates.items()}
        ms = {name: statistics.median(r) for name, r in attn.items()}
        print(
            f"prompt {prompt_len}, {new_tokens} new: decode op {med['op']:.2f} tok/s, sdpa {med['sdpa']:.2f} tok/s"
            f" ({med['op'] / med['sdpa']:.2f}x); attention op {ms['op']:.2f} ms/step, sdpa {ms['sdpa']:.2f} ms/step;"
            f" same tokens: {tokens['op'] == tokens['sdpa']}"
        )
    finally:
        TorchAttentionBackend.use_cpu_kernels = True
        TorchAttentionBackend.forward, TorchAttentionBackend.plan = forward, plan
        eng.shutdown()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[30, 1000])
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="A/B alternations; the median of each side is reported")
    ap.add_argument("--engine", action="store_true", help="time whole decode steps of the default model instead")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.engine:
        return engine(args.prompt, args.new_tokens, args.rounds)
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}, {args.dtype}, page {args.page_size}")
    for context in args.contexts:
        pool, batch = setup(context, args.requests, args.page_size, dtype)
        q = torch.randn(args.requests, HEADS, HEAD_DIM).to(dtype)
        k = torch.randn(args.requests, KV_HEADS, HEAD_DIM).to(dtype)
        v = torch.randn(args.requests, KV_HEADS, HEAD_DIM).to(dtype)
        sides = {}
        for name, on in (("op", True), ("sdpa", False)):
            backend = TorchAttentionBackend(pool, HEADS, HEAD_DIM)
            backend.use_cpu_kernels = on
            backend.plan(batch)
            sides[name] = backend
        outs = {name: b.forward(0, q, k, v).float() for name, b in sides.items()}
        err = (outs["op"] - outs["sdpa"]).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in sides}
        plans: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, backend in sides.items():
                t = time.perf_counter()
                for _ in range(args.iters):
                    backend.forward(0, q, k, v)
                times[name].append((time.perf_counter() - t) / args.iters * 1e6)
                t = time.perf_counter()
                for _ in range(20):
                    backend.plan(batch)
                plans[name].append((time.perf_counter() - t) / 20 * 1e6)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(
            f"context {context:5d} x {args.requests} req: per layer op {med['op']:7.1f} us, sdpa {med['sdpa']:7.1f} us"
            f" ({med['sdpa'] / med['op']:.1f}x); plan op {statistics.median(plans['op']):.0f} us,"
            f" sdpa {statistics.median(plans['sdpa']):.0f} us; max |op - sdpa| {err:.2e}"
            f"; load {os.getloadavg()[0]:.2f}"
        )


if __name__ == "__main__":
    main()
