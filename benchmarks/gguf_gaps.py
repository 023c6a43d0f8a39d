"""The GGUF linears of one decode step (24 layers' qkv, o, gate_up, down, then the LM head, one row each) with a
busy gap of `--gap` microseconds after each, as the step's serial work (norms, attention, Python) leaves between
them: the linears' wall time per step with and without `ahead` (the pool's worker prefetching the next linears'
blocks during the gaps, radixserve_kernels/cpu/spin_pool.h), the two interleaved step by step, medians. Prints the load:
the worker needs a core of its own, so a busy machine shows little either way.

    .venv/bin/python -m benchmarks.gguf_gaps [--gap 0 30 60] [--steps 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import radixserve_kernels.cpu as cpu_kernels
from benchmarks.gguf_linear import DEFAULT_GGUF
from radixserve.gguf.tensor_table import read_tensor_table

LAYER = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def step_linears(gguf: str) -> list[tuple[list[torch.Tensor], list[int], torch.Tensor]]:
    """(blocks, types, one activation row) of every linear of a decode step, in the order a step runs them."""
    table = read_tensor_table(gguf)

    def part(name: str) -> tuple[torch.Tensor, int]:
        t = table.tensors[name]
        return torch.from_numpy(t.data.reshape(t.shape[0], -1)), int(t.type)

    groups = [[f"blk.{i}.{n}.weight" for n in names] for i in range(24) for names in LAYER] + [["output.weight"]]
    out = []
    for names in groups:
        parts = [part(n) for n in names]
        k = 4864 if "ffn_down" in names[0] else 896
        out.append(([p for p, _ in parts], [t for _, t in parts], torch.randn(1, k).bfloat16()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF))
    ap.add_argument("--gap", type=float, nargs="+", default=[0, 30, 60], help="microseconds of busy work after each")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops = cpu_kernels.ops()
    seq = step_linears(a.gguf)
    # What gguf_model._prefetch_in_step_order hands each linear: the blocks of the next ones (the kernel takes 8 MB).
    ahead = [[b for j in range(1, 4) for b in seq[(i + j) % len(seq)][0]] for i in range(len(seq))]

    def step(gap: float, use: bool) -> float:
        linears = 0.0
        for i, (blocks, types, x) in enumerate(seq):
            t = time.perf_counter()
            ops.gguf_linear(x, blocks, types, None, ahead[i] if use else None)
            end = time.perf_counter()
            linears += end - t
            while time.perf_counter() - end < gap:
                pass
        return linears

    print(f"threads={a.threads} load={os.getloadavg()[0]:.1f} (medians of {a.steps} steps)")
    print("| gap after each linear (us) | linears ms per step, no prefetch | with prefetch | ratio |")
    print("|---|---|---|---|")
    for gap in a.gap:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.steps + 1):  # the first round warms up
            for use in (False, True):
                times[use].append(step(gap * 1e-6, use))
        off, on = (statistics.median(times[u][1:]) * 1e3 for u in (False, True))
        print(f"| {gap:.0f} | {off:.2f} | {on:.2f} | {on / off:.2f} |", flush=True)
    print(f"load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
