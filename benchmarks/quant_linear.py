"""Per-shape cost of one linear on this CPU: float32, bf16 (oneDNN-packed), int8 weight-only (our kernel below
INT8_KERNEL_ROWS rows, widened codes and a dense matmul above; with bf16 and with float32 activations, the AVX2
kinds' default), int4 weight-only (groups of 32/64/128, torch's op with bf16 activations: with float32 ones it
was 10-60x slower, RESULTS.md's issue-14 section).

The default model's projection shapes (Qwen2.5-0.5B: qkv 1152x896, o 896x896, gate_up 9728x896, down 896x4864,
lm_head 151936x896) at 1 and 96 rows: decode and an uncached prefill tail. Prints the CPU flags with the figures.

    .venv/bin/python -m benchmarks.quant_linear [--rows 1 96] [--iters 20] [--stat median|min]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.model import cpu_select
from radixserve.model.llama import Linear
from radixserve.model.quant import INT8_KERNEL_ROWS, Int4Linear, Int8Linear

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}


def _time(fn, iters: int, stat=statistics.median) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return stat(ts) * 1e6


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 96])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    # On an oversubscribed machine a 2-thread op waits a whole time slice whenever one thread is descheduled, so
    # the median there measures the load; the minimum measures the op when it gets the cores.
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    a = ap.parse_args()
    stat = statistics.median if a.stat == "median" else min
    print(
        f"cpu_kind={cpu_select.cpu_kind()} torch_cpu={cpu_select.cpu_capability()} threads={torch.get_num_threads()} "
        f"(int8 at >= {INT8_KERNEL_ROWS} rows: codes widened, dense matmul); {a.stat} of {a.iters}"
    )
    print(
        "| shape | rows | fp32 us | bf16 packed us | int8 (bf16 x) us | int8 (fp32 x) us | int4 g32 us | int4 g64 us "
        "| int4 g128 us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k) * 0.02
        bf = Linear(k, n, False, torch.bfloat16)
        bf.weight.data.copy_(w)
        if cpu_select.has_bf16_hardware():
            bf.pack()
        q = Int8Linear.from_float(w, None)
        q4 = [Int4Linear.from_float(w, None, g) for g in (32, 64, 128)]
        for m in a.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            row = [
                _time(lambda: torch.nn.functional.linear(x, w), a.iters, stat),
                _time(lambda: bf(xb), a.iters, stat),
                _time(lambda: q(xb), a.iters, stat),
                _time(lambda: q(x), a.iters, stat),
                *(_time(lambda lin=lin: lin(xb), a.iters, stat) for lin in q4),
            ]
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(f"{v:.0f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
