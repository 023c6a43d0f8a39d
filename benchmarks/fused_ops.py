"""The fused elementwise CPU ops a decode step runs per layer (radixserve_kernels/cpu/norm_rope.cpp, silu_mul.cpp) at
the default model's sizes, microseconds a call from Python (dispatch included: ~2-3 us, what a call with no work
costs). Run it in two checkouts to compare builds (each builds its own kernels).

    .venv/bin/python -m benchmarks.fused_ops [--rows 1 8] [--repeats 3000] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import radixserve_kernels.cpu as cpu_kernels

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 896, 4864, 14, 2, 64  # Qwen2.5-0.5B


def per_call_us(fn, repeats: int) -> float:
    for _ in range(repeats // 10):  # warm-up
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops = cpu_kernels.ops()
    assert ops is not None, "the CPU kernels did not build"
    print(
        f"CPU {cpu_kernels.cpu_model()} ({' '.join(cpu_kernels.kind_flags())}), torch {torch.__version__}, "
        f"threads={a.threads} load={os.getloadavg()[0]:.1f}; us a call, bfloat16"
    )
    print("| rows | add_rms_norm | silu_mul | rope_qk |")
    print("|---|---|---|---|")
    for rows in a.rows:
        torch.manual_seed(rows)
        h, res, w = (
            torch.randn(rows, HIDDEN).bfloat16(),
            torch.randn(rows, HIDDEN).bfloat16(),
            torch.randn(HIDDEN).bfloat16(),
        )
        gate_up = torch.randn(rows, 2 * INTER).bfloat16()
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
        q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
        cos, sin = (torch.randn(rows, 1, HEAD_DIM // 2).bfloat16() for _ in range(2))
        norm = per_call_us(lambda: ops.add_rms_norm(h, res, w, 1e-6), a.repeats)
        silu = per_call_us(lambda: ops.silu_mul(gate_up), a.repeats)
        rope = per_call_us(lambda: ops.rope_qk(q, k, cos, sin), a.repeats)
        print(f"| {rows} | {norm:.1f} | {silu:.1f} | {rope:.1f} |", flush=True)


if __name__ == "__main__":
    main()
