"""n-gram speculative decoding on the default model: the same requests on an engine with `speculative='off'` and one
with `speculative='ngram'` (both in this process, runs interleaved off/on so the shared machine's noise hits both),
one stream, greedy. Workloads: a code edit (the prompt holds a ~300-token function, the answer rewrites it with one
change), a second chat turn that revises the first answer, a RAG answer quoting a document, and random-topic prose
(nothing to copy). Prints decode tokens/s (after the first token) and end-to-end tokens/s for each, their ratio,
the acceptance rate and mean accepted length, and whether the tokens were the same.

    .venv/bin/python -m benchmarks.speculative [--reps 2] [--max-tokens 8]
    .venv/bin/python -m benchmarks.speculative --step-cost   # a verify step's cost by batch size (for `auto`)
    .venv/bin/python -m benchmarks.speculative --float32-check   # greedy tokens on vs off in float32 (60 tokens)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from radixserve import Engine
from radixserve.forward_batch import ForwardBatch
from radixserve.model import cpu_select

FUNCTION = '''def merge_intervals(intervals, min_gap=0, keep_labels=False):
    """Merge overlapping [start, end, label] intervals; gaps up to min_gap are bridged."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda item: (item[0], item[1]))
    merged = []
    current_start, current_end, current_label = ordered[0][0], ordered[0][1], ordered[0][2]
    for start, end, label in ordered[1:]:
        if start <= current_end + min_gap:
            current_end = max(current_end, end)
            if keep_labels and label not in current_label.split("+"):
                current_label = current_label + "+" + label
        else:
            merged.append((current_start, current_end, current_label))
            current_start, current_end, current_label = start, end, label
    merged.append((current_start, current_end, current_label))
    total = sum(end - start for start, end, _ in merged)
    longest = max(merged, key=lambda item: item[1] - item[0])
    print(f"merged {len(intervals)} intervals into {len(merged)}; covered {total}; longest {longest}")
    return merged
'''

DOCUMENT = (
    "The Riverside Library opens at 9 a.m. on weekdays and at 10 a.m. on Saturdays; it is closed on Sundays and "
    "public holidays. Members may borrow up to twelve items at a time, of which no more than four may be DVDs. "
    "Books are lent for three weeks and may be renewed twice online, unless another member has reserved them. "
    "Late returns cost 20 cents per item per day, capped at 6 dollars per item. Lost items are charged at their "
    "replacement cost plus a 5 dollar processing fee. The study rooms on the second floor can be booked for up to "
    "two hours per day through the library website, and bookings open seven days in advance. Printing costs 10 "
    "cents per black-and-white page and 50 cents per colour page; scanning is free. Children under twelve must be "
    "accompanied by an adult after 6 p.m. The library's wifi network is called RiversideGuest and needs no password."
)

TOPICS = [
    "a lighthouse keeper who collects shells",
    "the history of paper kites",
    "a city of talking bicycles",
    "why autumn leaves change colour",
    "a chess match on a night train",
    "the first bakery on the moon",
]


@dataclass
class Run:
    ids: list[int]
    decode_tps: float  # tokens after the first / time after the first token
    e2e_tps: float  # all tokens / whole request time


def workloads(eng: Engine, rng: random.Random) -> dict[str, tuple[list[int], int]]:
    """name -> (prompt ids, max_new_tokens)."""
    chat = eng.apply_chat_template
    code_edit = chat(
        [
            {
                "role": "user",
                "content": "Here is a Python function:\n\n```python\n" + FUNCTION + "```\n\n"
                "Rewrite the whole function with one change: rename the parameter `min_gap` to `max_gap`. "
                "Output only the complete code.",
            }
        ]
    )
    first_turn = [
        {
            "role": "user",
            "content": "Write a Python class `LRUCache` with get and put methods, using an OrderedDict. Only code.",
        }
    ]
    answer = eng.generate(input_ids=chat(first_turn), sampling_params={"max_new_tokens": 200, "temperature": 0})["text"]
    multi_turn = chat(
        first_turn
        + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Add a docstring to every method and show the full class again."},
        ]
    )
    rag = chat(
        [
            {"role": "system", "content": "Answer from the document only, quoting its sentences."},
            {
                "role": "user",
                "content": "Document:\n" + DOCUMENT + "\n\nWhat are the rules for borrowing, "
                "renewing and returning items late? Quote every relevant sentence.",
            },
        ]
    )
    prose = chat([{"role": "user", "content": f"Write a short story about {rng.choice(TOPICS)}."}])
    return {"code-edit": (code_edit, 400), "multi-turn": (multi_turn, 300), "rag": (rag, 200), "prose": (prose, 160)}


def run_once(eng: Engine, ids: list[int], max_new: int) -> Run:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new, "temperature": 0})
    wall = time.perf_counter() - t0
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    decode_s = meta["e2e_latency"] - meta["ttft"]
    return Run(out["output_ids"], (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, n / wall)


def spec_counts(eng: Engine) -> tuple[int, int, int]:
    s = eng.cache_stats()
    return sum(s["spec_draft_tokens"].values()), sum(s["spec_accepted_tokens"].values()), s["spec_verify_steps"]


def step_cost(eng: Engine, batches: tuple[int, ...] = (1, 2, 4, 8), extra: int = 8, iters: int = 5) -> None:
    """Median forward time of B requests x 1 token against B x (1 + extra) tokens over 300 cached tokens each: what
    verifying a draft costs at each batch size (on the loop thread, between requests, with pages borrowed)."""
    ps, prefix = eng.runner.pool.page_size, 300

    def measure(b: int, n: int) -> float:
        pool = eng.runner.pool
        per = -(-(prefix + n) // ps)
        pages = pool.alloc(per * b)
        assert pages is not None
        try:
            tables = [pages[i * per : (i + 1) * per] for i in range(b)]
            fb = ForwardBatch.build(
                [[100] * n] * b, [prefix] * b, tables, ps, [i * n + j for i in range(b) for j in range(n)]
            )
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                eng.runner.forward(fb)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            pool.free(pages)

    print("| decodes in the step | 1 token each (ms) | 1 + 8 tokens each (ms) | cost ratio |")
    print("|---|---|---|---|")
    for b in batches:
        one, many = eng.loop.call(lambda: measure(b, 1)), eng.loop.call(lambda: measure(b, 1 + extra))
        print(f"| {b} | {one * 1e3:.1f} | {many * 1e3:.1f} | {many / one:.2f}x |", flush=True)


def float32_check(new_tokens: int = 60) -> None:
    """Whether greedy answers are the same with speculation on and off in float32 (bf16 rounding aside)."""
    engs = {m: Engine(dtype="float32", speculative=m) for m in ("off", "ngram")}
    try:
        loads = workloads(engs["off"], random.Random(0))
        for name in ("multi-turn", "prose"):
            ids, _ = loads[name]
            outs = {
                m: e.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0})[
                    "output_ids"
                ]
                for m, e in engs.items()
            }
            steps = engs["ngram"].cache_stats()["spec_verify_steps"]
            print(
                f"{name}: float32 {'same' if outs['off'] == outs['ngram'] else 'DIFFERENT'} tokens "
                f"({len(outs['off'])} tokens; verify steps so far {steps})",
                flush=True,
            )
    finally:
        for e in engs.values():
            e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="--speculative-max-tokens of the 'on' engine")
    ap.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    ap.add_argument("--step-cost", action="store_true", help="only measure a verify step's cost by batch size")
    ap.add_argument("--float32-check", action="store_true", help="only compare greedy tokens on/off in float32")
    a = ap.parse_args()
    print(
        f"cpu={cpu_select.cpu_capability()} bf16_hw={cpu_select.has_bf16_hardware()} threads={torch.get_num_threads()}"
    )
    if a.float32_check:
        float32_check()
        return
    if a.step_cost:
        with Engine(speculative="off") as eng:
            step_cost(eng)
        return
    off = Engine(speculative="off")
    on = Engine(speculative="ngram", speculative_max_tokens=a.max_tokens)
    info = off.model_info()
    print(
        f"model={info['model_name']} dtype={info['dtype']} quantization={info['quantization']} "
        f"speculative_max_tokens={a.max_tokens}"
    )
    try:
        loads = workloads(off, random.Random(0))
        print(
            "| workload | prompt tokens | answer tokens | decode tok/s off | on | ratio | end-to-end tok/s off | on | "
            "ratio | acceptance | mean accepted length | same tokens |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, (ids, max_new) in loads.items():
            if a.only and name not in a.only:
                continue
            for eng in (off, on):  # warm the cache with the prompt, so both measure decode over a cached prefix
                eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
            before = spec_counts(on)
            runs: dict[str, list[Run]] = {"off": [], "on": []}
            for rep in range(a.reps):
                order = (("off", off), ("on", on)) if rep % 2 == 0 else (("on", on), ("off", off))
                for label, eng in order:
                    runs[label].append(run_once(eng, ids, max_new))
            after = spec_counts(on)
            proposed, accepted, steps = (x - y for x, y in zip(after, before))
            print(row(name, len(ids), runs, proposed, accepted, steps), flush=True)
    finally:
        off.shutdown()
        on.shutdown()


def row(name: str, prompt_len: int, runs: dict[str, list[Run]], proposed: int, accepted: int, steps: int) -> str:
    def med(label: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs[label])

    d_off, d_on, e_off, e_on = (
        med("off", "decode_tps"),
        med("on", "decode_tps"),
        med("off", "e2e_tps"),
        med("on", "e2e_tps"),
    )
    ref = runs["off"][0].ids
    diverge = [next((i for i, (x, y) in enumerate(zip(r.ids, ref)) if x != y), None) for r in runs["off"] + runs["on"]]
    diverge += [min(len(r.ids), len(ref)) for r in runs["off"] + runs["on"] if len(r.ids) != len(ref)]
    first = min((d for d in diverge if d is not None), default=None)
    same = "yes" if first is None else f"no: from token {first}"
    rate = accepted / proposed if proposed else 0.0
    mean_len = (accepted + steps) / steps if steps else 0.0
    return (
        f"| {name} | {prompt_len} | {len(runs['off'][0].ids)} | {d_off:.1f} | {d_on:.1f} | {d_on / d_off:.2f}x | "
        f"{e_off:.1f} | {e_on:.1f} | {e_on / e_off:.2f}x | {rate:.0%} ({accepted}/{proposed}) | {mean_len:.2f} | "
        f"{same} |"
    )


if __name__ == "__main__":
    main()
