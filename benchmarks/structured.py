"""Constrained decoding cost and jump-forward gain on a JSON extraction workload (issue 17).

Each round runs the same requests (1 or 8 concurrent streams, greedy) three ways, interleaved so that the shared
machine's noise hits all alike:
  - free:     no grammar, `ignore_eos` and max_new_tokens set to the tokens the constrained run produced (same work)
  - json:     json_schema, jump-forward off (every token sampled under the mask)
  - json+jf:  json_schema, jump-forward on (forced tokens appended, run as an extend chunk)
It reports output tokens per second of each (median over rounds), the constrained/free ratio per token, and the
decode steps and wall time jump-forward saves.

    .venv/bin/python -m benchmarks.structured [--model PATH] [--rounds 3] [--streams 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from radixserve import Engine
from radixserve.constrained.bitmask import StepMasks
from radixserve.model import cpu_select

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["invoice", "vendor", "date", "currency", "items", "paid"],
    "properties": {
        "invoice": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "vendor": {"type": "string", "maxLength": 32},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "quantity", "unit_price"],
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 100000},
                },
            },
        },
        "paid": {"type": "boolean"},
    },
}
DOCS = [
    "Invoice 1042 from Acme Tools, dated 2024-03-05, in USD: 3 hammers at 12.5 each and 10 boxes of nails at 4. Paid.",
    "Bill no. 77 issued by Nordic Paper AB on 2023-11-20 (EUR): 500 sheets of A4 paper at 0.02. Not yet paid.",
    "Invoice #5521, Baker Street Books, 2024-01-15, GBP. Items: 2 atlases at 35, 1 dictionary at 22.99. Paid in full.",
    "Invoice 300 from Cloud Hosting Ltd, 2024-06-30, USD: 1 server month at 89. Payment pending.",
    "Invoice 18 by Green Garden Co, 2022-04-02, EUR: 12 tulip bulbs at 0.8, 3 pots at 6.5, 1 spade at 19. Paid.",
    "Invoice 9090, Metro Coffee, 2024-02-29, USD: 40 bags of beans at 14. Unpaid.",
    "Invoice 4410 from Lumen Lights, 2023-09-09, GBP: 6 lamps at 45 and 6 bulbs at 3.2. Paid.",
    "Invoice 61 from Swift Couriers, 2024-05-01, EUR: 25 deliveries at 7.5. Outstanding.",
]


LAST_OUTPUTS: list[list[int]] = []


def mask_cost(eng: Engine, outputs: list[list[int]]) -> float:
    """Milliseconds per step that the grammar work of these outputs costs, replayed without the model: each step
    fills and applies the bitmask of every live row (StepMasks, as the runner does) and accepts its token (as the
    scheduler does). This is the constrained/free difference in CPU work, free of the shared machine's noise."""
    compiled = eng.grammars.compile("json_schema", SCHEMA)
    matchers = [eng.grammars.matcher(compiled) for _ in outputs]
    logits = torch.zeros(len(outputs), eng.runner.config.vocab_size)
    steps = max(len(o) for o in outputs)
    t = time.perf_counter()
    for k in range(steps):
        live = [i for i, o in enumerate(outputs) if k < len(o)]
        StepMasks(list(range(len(live))), [matchers[i] for i in live]).apply(logits[: len(live)])
        for i in live:
            matchers[i].accept(outputs[i][k])
    return (time.perf_counter() - t) / steps * 1e3


def prompts(eng: Engine, n: int) -> list[list[int]]:
    return [
        eng.apply_chat_template([{"role": "user", "content": f"Extract the invoice as JSON.\n\n{DOCS[i % 8]}"}])
        for i in range(n)
    ]


def run(eng: Engine, ids: list[list[int]], params: list[dict[str, Any]]) -> tuple[float, list[int], int, int]:
    """(wall seconds, output tokens per request, scheduler steps, forced tokens) of one concurrent batch."""
    global LAST_OUTPUTS
    stats = eng.scheduler.stats
    steps0, forced0 = stats.steps, stats.forced_tokens
    t = time.perf_counter()
    outs = eng.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t
    LAST_OUTPUTS = [o["output_ids"] for o in outs]
    return (
        wall,
        [o["meta_info"]["completion_tokens"] for o in outs],
        stats.steps - steps0,
        stats.forced_tokens - forced0,
    )


def bench(eng: Engine, streams: int, rounds: int, max_new: int) -> dict[str, Any]:
    ids = prompts(eng, streams)
    json_params = [{"max_new_tokens": max_new, "temperature": 0.0, "json_schema": SCHEMA}] * streams
    warm = eng.generate(input_ids=ids, sampling_params=json_params)  # warm: prompts cached, schema compiled
    eng.generate(
        input_ids=ids,
        sampling_params=[
            {"max_new_tokens": o["meta_info"]["completion_tokens"], "temperature": 0.0, "ignore_eos": True}
            for o in warm
        ],
    )
    res: dict[str, list] = {"free": [], "json": [], "json+jf": []}
    for _ in range(rounds):
        eng.scheduler.cfg.enable_jump_forward = False
        wall, toks, steps, _ = run(eng, ids, json_params)
        res["json"].append((wall, sum(toks), steps, 0))
        res["mask_ms"] = [mask_cost(eng, LAST_OUTPUTS)]
        free = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in toks]
        wall, ftoks, steps, _ = run(eng, ids, free)
        res["free"].append((wall, sum(ftoks), steps, 0))
        eng.scheduler.cfg.enable_jump_forward = True
        wall, toks, steps, forced = run(eng, ids, json_params)
        res["json+jf"].append((wall, sum(toks), steps, forced))
    return res


def median_rate(rows: list[tuple]) -> tuple[float, float, float, float]:
    """(median tok/s, median wall, median steps, median forced)."""
    return (
        statistics.median(t / w for w, t, _, _ in rows),
        statistics.median(w for w, *_ in rows),
        statistics.median(s for *_, s, _ in rows),
        statistics.median(f for *_, f in rows),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=160)
    a = ap.parse_args()
    print(f"cpu={cpu_select.cpu_capability()} torch_threads={torch.get_num_threads()}")
    with Engine(model=a.model, dtype=a.dtype) as eng:
        print(f"model={eng.model_info()['model_name']} dtype={eng.dtype_name}")
        print(
            "| streams | mode | output tok/s (median) | vs free per token | wall s | scheduler steps | forced tokens |"
        )
        print("|---|---|---|---|---|---|---|")
        for streams in a.streams:
            res = bench(eng, streams, a.rounds, a.max_new_tokens)
            free_rate, free_wall, free_steps, _ = median_rate(res["free"])
            for mode in ("free", "json", "json+jf"):
                rate, wall, steps, forced = median_rate(res[mode])
                print(
                    f"| {streams} | {mode} | {rate:.1f} | {rate / free_rate - 1:+.1%} | {wall:.2f} | {steps:.0f} | "
                    f"{forced:.0f} |",
                    flush=True,
                )
            step_ms = free_wall / free_steps * 1e3
            print(
                f"| {streams} | grammar work alone (replayed) | {res['mask_ms'][0]:.2f} ms/step | "
                f"{res['mask_ms'][0] / step_ms:+.1%} of a free step ({step_ms:.0f} ms) | | | |",
                flush=True,
            )


if __name__ == "__main__":
    main()
