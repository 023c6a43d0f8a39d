"""Tensor parallel step time on CPU: one forward at tp=1 vs tp=2 (gloo, 2 ranks on this machine), interleaved.

Rank 0 is this process and holds both a whole-model runner and its tp=2 shard; the worker rank is spawned as
`radixserve serve --tp 2` would. Each repetition times the tp=1 step (all of this process's threads) and then the
tp=2 step (threads split between the ranks, as --tp does), so the ratio compares like with like on a noisy machine.
On a CPU both ranks share the same cores and memory bandwidth: tp=2 can only add the collectives' cost. The figure
says what the communication costs, not what tensor parallelism gains on GPUs (no multi-GPU machine has run this).

    .venv/bin/python -m benchmarks.tp [--model PATH] [--dtype bfloat16] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see radixserve/__init__.py)
import torch  # noqa: E402

from radixserve import distributed  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model import cpu_select  # noqa: E402
from radixserve.model.resolve import resolve_model  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402
from radixserve.tp_worker import worker_settings  # noqa: E402

PAGE = 16


def cases(vocab: int) -> dict[str, ForwardBatch]:
    """Decode at 1 and 8 streams over 128 tokens of context, and a 256-token prefill chunk; pages 1.. are used."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, streams, ctx, new in (("decode x1", 1, 128, 1), ("decode x8", 8, 128, 1), ("prefill 256", 1, 0, 256)):
        per = -(-(ctx + new) // PAGE)
        tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(streams)]
        chunks = [torch.randint(1000, vocab - 1000, (new,), generator=g).tolist() for _ in range(streams)]
        rows = [sum(new for _ in range(i + 1)) - 1 for i in range(streams)]
        out[name] = ForwardBatch.build(chunks, [ctx] * streams, tables, PAGE, rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF folder (default: the default model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    path = resolve_model(a.model)
    dtype, cpu = getattr(torch, a.dtype), torch.device("cpu")
    threads = torch.get_num_threads()
    print(
        f"cpu={cpu_select.cpu_capability()} bf16_hw={cpu_select.has_bf16_hardware()} threads={threads} "
        f"model={path.name} dtype={a.dtype}",
        flush=True,
    )
    settings = worker_settings(str(path), a.dtype, "cpu", PAGE, 4096, "torch", 8, None, "none")
    tp = distributed.start(2, cpu, [json.dumps(settings)])
    assert tp is not None
    try:
        args = dict(
            dtype=dtype,
            device=cpu,
            page_size=PAGE,
            max_total_tokens=4096,
            attention_backend="torch",
            max_running_requests=8,
        )
        one, two = ModelRunner(path, **args), ModelRunner(path, tp=tp, **args)
        half = max(1, threads // 2)
        # tp=1 with all threads, tp=1 with the threads one rank gets, tp=2 (one rank's threads each)
        configs = (("all", one, threads, None), ("half", one, half, None), ("tp2", two, half, tp))
        print(
            f"| step | tp=1, {threads} threads: ms | tp=1, {half} thread(s): ms | tp=2, {half} each: ms "
            f"| tp=2 / tp=1 ({threads} threads) |\n|---|---|---|---|---|"
        )
        for name, batch in cases(one.config.vocab_size).items():
            times: dict[str, list[float]] = {c[0]: [] for c in configs}
            for rep in range(a.reps + 1):  # the first repetition warms up
                for key, runner, n, group in configs:
                    torch.set_num_threads(n)
                    start = time.perf_counter()
                    if group is not None:
                        group.send_batch(batch)
                    runner.forward(batch)
                    if rep:
                        times[key].append((time.perf_counter() - start) * 1e3)
            m = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"| {name} | {m['all']:.1f} | {m['half']:.1f} | {m['tp2']:.1f} | {m['tp2'] / m['all']:.2f} |",
                flush=True,
            )
    finally:
        tp.close()


if __name__ == "__main__":
    main()
