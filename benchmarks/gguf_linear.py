"""The GGUF block linears (radixserve_kernels/cpu/gguf_linear.cpp) against our int8 linear on the same weights, per
projection of the default model: one pass over all 24 layers' tensors (so the weights come from DRAM as in a decode
step, not from a cache that one layer's matrix would fit), the two interleaved in one process, medians. Prints the load.
The int8 side runs its batch-invariant path at every row count, as deterministic mode (on by default on AVX-512
BF16) does; `--dense-int8` gives it the dense matmul from 48 rows on instead, as without that mode.

    .venv/bin/python -m benchmarks.gguf_linear [--threads 1] [--rows 1 96] [--repeats 9] [--projections o down]
        [--layers 24] [--first-layer 0] [--no-int8] [--dense-int8] [--best] [--huge-pages]

The kernels' compute alone, steady on a noisy host (the same figure within ~1% between runs where medians swung
30%): `--layers 1 --repeats 2000 --best`, one layer from the caches, the fastest pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import radixserve_kernels.cpu as cpu_kernels
from radixserve.gguf.huge_pages import HugePageMover, page_runs
from radixserve.gguf.tensor_table import read_tensor_table
from radixserve.model.gguf_linear import BlockPart, GGUFLinear
from radixserve.model.quant import Int8Linear

DEFAULT_GGUF = Path.home() / ".cache" / "radixserve" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# Our projection -> the GGUF tensors stacked into it (gguf_model._FUSED); lm_head is `output.weight` alone.
PROJECTIONS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
    "lm_head": (),
}


def layers_of(table, projection: str, layers: int, first: int = 0) -> list[GGUFLinear]:
    def part(name: str) -> BlockPart:
        t = table.tensors[name]
        return BlockPart(torch.from_numpy(t.data.reshape(t.shape[0], -1)), t.type)

    if projection == "lm_head":
        names = [["output.weight"]]
    else:
        names = [[f"blk.{i}.{n}.weight" for n in PROJECTIONS[projection]] for i in range(first, first + layers)]
    out = []
    for group in names:
        parts = [part(n) for n in group]
        k = cpu_kernels.ops().gguf_dequantize(parts[0].blocks, int(parts[0].type), None).shape[1]
        out.append(GGUFLinear(parts, k, None))
    return out


def as_int8(lin: GGUFLinear) -> Int8Linear:
    ops = cpu_kernels.ops()
    w = torch.cat([ops.gguf_dequantize(p.blocks, int(p.type), None) for p in lin.parts])
    return Int8Linear.from_float(w, None)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--projections", nargs="+", default=list(PROJECTIONS))
    ap.add_argument("--layers", type=int, default=24, help="fewer: the weights stay in the caches (compute-bound)")
    ap.add_argument(
        "--first-layer",
        type=int,
        default=0,
        help="the first layer timed (layer 2: down's Q4_K; layers 0 and 1 hold Q6_K)",
    )
    ap.add_argument("--no-int8", action="store_true", help="time the GGUF kernels alone")
    ap.add_argument(
        "--dense-int8", action="store_true", help="int8 from 48 rows on by the dense matmul (not in deterministic mode)"
    )
    ap.add_argument("--wall", action="store_true", help="wall time (default with one thread: this thread's CPU time)")
    ap.add_argument("--best", action="store_true", help="the fastest pass instead of the median")
    ap.add_argument("--huge-pages", action="store_true", help="the blocks moved onto huge pages, as the engine does")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    # One thread's CPU time is what the kernel costs even on a loaded machine (it excludes the time slices other
    # processes take); with several threads only the wall clock tells how they overlap.
    clock = time.thread_time if a.threads == 1 and not a.wall else time.perf_counter
    pick = min if a.best else statistics.median
    table = read_tensor_table(a.gguf)
    print(
        f"threads={a.threads} load={os.getloadavg()[0]:.1f} clock={clock.__name__} "
        f"({'fastest' if a.best else 'medians'} of {a.repeats}, one pass over {a.layers} layers)"
    )
    print("| projection | blocks | rows | gguf ms | GB/s | int8 ms | GB/s | gguf / int8 time |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.projections:
        gg = layers_of(table, name, a.layers, a.first_layer)
        if a.huge_pages:
            ranges = [(p.blocks.data_ptr(), p.blocks.numel()) for lin in gg for p in lin.parts]
            HugePageMover(table.mapped, page_runs(table.mapped, ranges)).start().join()
        q8 = [] if a.no_int8 else [as_int8(lin) for lin in gg]
        for q in q8:  # as deterministic mode runs them (the default on AVX-512 BF16): one path for every row count
            q.batch_invariant = not a.dense_int8
        g_bytes = sum(p.blocks.numel() for lin in gg for p in lin.parts)
        q_bytes = sum(q.codes.numel() for q in q8)
        types = "+".join(p.type.name for p in gg[0].parts)
        for m in a.rows:
            x = torch.randn(m, gg[0].in_features).bfloat16()
            sides = [gg] + ([q8] if q8 else [])
            times: list[list[float]] = [[] for _ in sides]
            for _ in range(a.repeats + 1):  # the first round warms up
                for s, lins in enumerate(sides):
                    t = clock()
                    for lin in lins:
                        lin(x)
                    times[s].append(clock() - t)
            g = pick(times[0][1:])
            row = f"| {name} | {types} | {m} | {g * 1e3:.3f} | {g_bytes / g / 1e9:.1f} |"
            if q8:
                q = pick(times[1][1:])
                row += f" {q * 1e3:.3f} | {q_bytes / q / 1e9:.1f} | {g / q:.2f} |"
            print(row, flush=True)
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
