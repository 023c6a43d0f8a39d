"""The cost of `--deterministic` (issue 39) on the default model at the default CPU dtype and quantization.

Two engines in one process, `Engine(deterministic=False)` and `Engine(deterministic=True)`, measured interleaved on the same
prompts (this machine is shared; read the ratios): decode tokens/s at 1 and 8 streams (64-token prompts of real
code, greedy, ignore_eos) and prefill tokens/s of a 1024- and a 4096-token prompt (time to first token, cache
flushed; the long one because every prompt token attends as a row of its own in deterministic mode).
Speculation is off in both, so the figures are the kernels' alone. Prints a markdown table and appends it to
benchmarks/RESULTS.md (unless --no-record).

    .venv/bin/python -m benchmarks.deterministic_cost [--repeats 1] [--new-tokens 32] [--no-record]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py sets it, before torch loads

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402

from benchmarks.cpu_speed import BATCH, DECODE_PROMPT_LEN, PREFILL_LEN, Ours  # noqa: E402
from benchmarks.cpu_speed import source_tokens  # noqa: E402
from benchmarks.deterministic_linears import record  # noqa: E402
from radixserve import Engine  # noqa: E402

MODES = ("off", "deterministic")
LONG_PREFILL = 4096


def measure(repeats: int, new_tokens: int) -> tuple[dict[tuple[str, str], list[float]], str]:
    """tokens/s by (mode, case) over `repeats` interleaved rounds; and the dtype/quantization the engines chose."""
    engines = {m: Engine(deterministic=m == "deterministic", speculative="off", max_total_tokens=16384) for m in MODES}
    ours = {m: Ours(e) for m, e in engines.items()}
    ids = source_tokens(engines["off"].encode, LONG_PREFILL + BATCH * DECODE_PROMPT_LEN)
    prompts = [ids[LONG_PREFILL + i * DECODE_PROMPT_LEN :][:DECODE_PROMPT_LEN] for i in range(BATCH)]
    cases = {
        "decode1": lambda o: o.decode(prompts[:1], new_tokens),
        "decode8": lambda o: o.decode(prompts, new_tokens),
        "prefill": lambda o: PREFILL_LEN / o.prefill(ids[:PREFILL_LEN]),
        "prefill_long": lambda o: LONG_PREFILL / o.prefill(ids[:LONG_PREFILL]),
    }
    for o in ours.values():  # warm-up: first-call allocations and thread start-up
        o.decode(prompts[:2], 4)
    res: dict[tuple[str, str], list[float]] = {(m, c): [] for m in MODES for c in cases}
    for rep in range(repeats):
        for c, case in cases.items():
            for m in MODES if rep % 2 == 0 else MODES[::-1]:  # alternate who goes first
                res[(m, c)].append(case(ours[m]))
        print(f"round {rep + 1}: " + ", ".join(f"{m} {c} {res[(m, c)][-1]:.1f}" for c in cases for m in MODES))
    chose = f"{engines['off'].dtype_name}, {engines['off'].quantization}"
    for e in engines.values():
        e.shutdown()
    return res, chose


def cost_table(res: dict[tuple[str, str], list[float]], names: dict[str, str]) -> str:
    """Medians and bests of each mode, and the change: the median over rounds of deterministic / off measured
    back to back (adjacent measurements share the machine's load, so their ratio is steadier than either)."""
    lines = [
        "| measure | --no-deterministic: median (best) | --deterministic: median (best) | change (median of paired ratios) |",
        "|---|---|---|---|",
    ]
    for c, name in names.items():
        off, det = res[(MODES[0], c)], res[(MODES[1], c)]
        change = statistics.median(d / o for o, d in zip(off, det)) - 1
        cells = [f"{statistics.median(x):.1f} ({max(x):.1f})" for x in (off, det)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {100 * change:+.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every measurement")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per decode request")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    res, chose = measure(args.repeats, args.new_tokens)
    names = {
        "decode1": "decode, 1 stream (tokens/s)",
        "decode8": f"decode, {BATCH} streams (tokens/s, all requests)",
        "prefill": f"prefill, {PREFILL_LEN}-token prompt (tokens/s)",
        "prefill_long": f"prefill, {LONG_PREFILL}-token prompt (tokens/s)",
    }
    table = cost_table(res, names)
    print(table)
    if args.no_record:
        return
    record(
        "## The cost of --deterministic (issue 39)",
        started,
        f"benchmarks.deterministic_cost --repeats {args.repeats} --new-tokens {args.new_tokens}",
        f"- Model: the default (Qwen2.5-Coder-0.5B-Instruct), `Engine` defaults ({chose}) with speculation off, "
        f"{args.repeats} interleaved round(s); decode: {args.new_tokens} greedy tokens per request after "
        f"{DECODE_PROMPT_LEN}-token prompts.\n\n{table}",
    )


if __name__ == "__main__":
    main()
