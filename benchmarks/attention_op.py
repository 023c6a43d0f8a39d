"""The CPU attention op alone (radixserve_kernels/cpu/decode_attention.cpp) on the default model's shapes (14 query
heads, 2 KV heads, head_dim 64, bfloat16 pages of 16), in the three ways an engine step calls it:

- `prefill`: the 256 rows of one prefill chunk after a cached prefix, each row over one request's keys up to itself
  (1,201-1,456 keys), the pages in cache;
- `decode`: 1 and 8 decode rows of their own requests at 1,000 keys and 8 at 100, each call's pages in cache;
- `step`: one decode step's 24 layers, each with its own pool, eight requests at `--keys` keys on shuffled pages:
  the keys and values come from memory, as in the engine (98 MB a step at 1,000 keys).

Best of 5 repeats, times per call (per step for `step`). To compare two builds, run it from each checkout in turn
(PYTHONPATH=<checkout>; the kernels build on first use):

    .venv/bin/python -m benchmarks.attention_op [--label new] [--keys 1000 200]
"""

from __future__ import annotations

import argparse
import time

import torch

import radixserve_kernels.cpu

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 14, 2, 64, 16, 24
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def pool(pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()


def requests(lens: list[int], gen: torch.Generator, shared: bool = False) -> Case:
    """q, K and V pages, page table and lengths: each request on its own shuffled pages, or (shared) every row on
    the pages of one request of the longest length, as a prefill chunk's rows are."""
    per = [-(-n // PAGE) for n in ([max(lens)] if shared else lens)]
    order = (torch.randperm(sum(per), generator=gen) + 1).int()
    rows = [order[sum(per[:r]) : sum(per[: r + 1])] for r in range(len(per))]
    table = torch.stack(rows * len(lens) if shared else rows)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).bfloat16()
    k, v = pool(1 + sum(per), gen), pool(1 + sum(per), gen)
    return q, k, v, table.contiguous(), torch.tensor(lens, dtype=torch.int32)


def best(fn, iters: int) -> float:
    """Best of 5 repeats of `iters` calls after 3 warm-up calls: seconds a call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--keys", type=int, nargs="+", default=[1000, 200], help="keys a request in the `step` setting")
    args = ap.parse_args()
    ops = radixserve_kernels.cpu.ops()
    assert ops is not None, "the CPU kernels did not build"
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    out = []
    calls = [
        ("prefill 256 rows at 1,201-1,456 keys", requests(list(range(1201, 1457)), gen, shared=True), 10),
        ("decode 1 row at 1,000 keys", requests([1000], gen), 400),
        ("decode 8 rows at 1,000 keys", requests([1000] * 8, gen), 100),
        ("decode 8 rows at 100 keys", requests([100] * 8, gen), 400),
    ]
    for name, case, iters in calls:
        out.append(f"{name}: {best(lambda c=case: ops.decode_attention(*c, scale), iters) * 1e6:.1f} us")
    for keys in args.keys:
        q, _, _, table, lens = requests([keys] * 8, gen)
        layers = [(pool(1 + table.numel(), gen), pool(1 + table.numel(), gen)) for _ in range(LAYERS)]

        def step() -> None:
            for k, v in layers:
                ops.decode_attention(q, k, v, table, lens, scale)

        out.append(f"step of 24 layers, 8 rows at {keys} keys from memory: {best(step, 10) * 1e3:.2f} ms")
    flags = radixserve_kernels.cpu.kind_flags()
    print(f"{args.label} ({' '.join(flags)}, {torch.get_num_threads()} threads): " + "; ".join(out), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
