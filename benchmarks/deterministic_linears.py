"""The int8 linears of one forward of the default model's shapes, with and without the batch-invariant path (issue
39), timed as best of many interleaved passes: on a shared machine the best pass is the least disturbed one, so
this resolves differences of a few percent that end-to-end medians (benchmarks/deterministic_cost.py) cannot.

Every layer gets its own random int8 codes (24 layers of Qwen2.5-0.5B's qkv, o, gate_up and down, plus the
151,936-row LM head: 0.5 GB), so a pass streams the weights from memory as a real decode step does. Rows: 1 and
8 (decode at 1 and 8 streams: every layer and the head), 512 (a prefill chunk: the layers only, the head scores
one row a request). Prints a markdown table and appends it to benchmarks/RESULTS.md (unless --no-record).

    .venv/bin/python -m benchmarks.deterministic_linears [--passes 20] [--no-record]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py sets it, before torch loads

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.cpu_speed import git_commit, machine  # noqa: E402
from radixserve_kernels.cpu import kind_flags  # noqa: E402
from radixserve.model.quant import Int8Linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HIDDEN, INTER, QKV, VOCAB = 24, 896, 4864, 1152, 151936
ROWS = (1, 8, 512)


def random_linear(n: int, k: int, gen: torch.Generator) -> Int8Linear:
    """An int8 linear of random codes (the kernels' speed does not depend on the values)."""
    codes = torch.randint(0, 256, (n // 8, k // 64, 8, 64), dtype=torch.uint8, generator=gen)
    return Int8Linear.from_packed(codes, torch.rand(n, generator=gen) * 0.01, k, n, None)


def model_linears() -> tuple[list[Int8Linear], Int8Linear]:
    gen = torch.Generator().manual_seed(0)
    shapes = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
    return [random_linear(n, k, gen) for _ in range(LAYERS) for n, k in shapes], random_linear(VOCAB, HIDDEN, gen)


@torch.inference_mode()
def one_pass(layers: list[Int8Linear], head: Int8Linear, rows: int, invariant: bool) -> float:
    """Seconds for every layer's linear on `rows` rows of bf16 input (and the head, for decode)."""
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    for lin in (*layers, head):
        lin.batch_invariant = invariant
    t = time.perf_counter()
    for lin in layers:
        lin(xs[lin.in_features])
    if rows <= 8:
        head(xs[HIDDEN])
    return time.perf_counter() - t


def measure(passes: int) -> dict[tuple[int, bool], float]:
    """Best seconds per (rows, invariant) over `passes` interleaved passes (prefill: a fifth as many)."""
    layers, head = model_linears()
    best: dict[tuple[int, bool], float] = {}
    for rows in ROWS:
        for p in range(passes if rows <= 8 else max(2, passes // 5)):
            for invariant in (False, True) if p % 2 == 0 else (True, False):
                s = one_pass(layers, head, rows, invariant)
                best[(rows, invariant)] = min(best.get((rows, invariant), s), s)
        print(f"{rows} rows: {best[(rows, False)] * 1e3:.2f} vs {best[(rows, True)] * 1e3:.2f} ms", flush=True)
    return best


def record(heading: str, started: datetime.datetime, command: str, body: str) -> None:
    """Append a section (heading, date, machine and CPU flags, commit, command, body) to benchmarks/RESULTS.md."""
    section = (
        f"\n{heading}\n\n- Date: {started:%Y-%m-%d %H:%M} UTC. Machine: {machine()}; CPU flags: "
        f"{' '.join(kind_flags())}; shared with other jobs.\n"
        f"- Commit: {git_commit()}. Command: `.venv/bin/python -m {command}`\n{body}\n"
    )
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:  # append only: other benchmarks add their own
        f.write(section)
    print("appended to benchmarks/RESULTS.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=20, help="interleaved passes per row count (best of them)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    best = measure(args.passes)
    lines = ["| rows per step | default paths (ms) | batch-invariant path (ms) | change in time |", "|---|---|---|---|"]
    for rows in ROWS:
        off, on = best[(rows, False)] * 1e3, best[(rows, True)] * 1e3
        what = "layers + LM head" if rows <= 8 else "layers"
        lines.append(f"| {rows} ({what}) | {off:.2f} | {on:.2f} | {100 * (on / off - 1):+.1f}% |")
    table = "\n".join(lines)
    print(table)
    if args.no_record:
        return
    record(
        "### The int8 linears alone, best of interleaved passes (issue 39)",
        started,
        f"benchmarks.deterministic_linears --passes {args.passes}",
        f"\n{table}",
    )


if __name__ == "__main__":
    main()
