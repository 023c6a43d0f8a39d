"""n-gram speculative decoding on the default model: the same requests on an engine with `speculative='off'` and one
with `speculative='auto'` (the default; both in this process, runs interleaved off/on so the shared machine's noise
hits both), one stream. Workloads (benchmarks/spec_workloads.py): a code edit (the prompt holds a ~300-token
function, the answer rewrites it with one change), a second chat turn that revises the first answer, a RAG answer
quoting a document, greedy; and six open-ended prose requests on unrelated topics (nothing to copy), once with the
model's default sampling and once greedy. Prints decode tokens/s (after the first token) and end-to-end tokens/s for
each, their ratio, the acceptance rate, the mean accepted length, how much each answer repeats itself (the share of
its 4-grams seen earlier in it) and whether greedy tokens were the same.

    .venv/bin/python -m benchmarks.speculative [--reps 2] [--max-tokens 8] [--only prose-sampled ...]
    .venv/bin/python -m benchmarks.speculative --step-cost   # a verify step's cost by batch size (for `auto`)
    .venv/bin/python -m benchmarks.speculative --float32-check   # greedy tokens on vs off in float32 (60 tokens)
    .venv/bin/python -m benchmarks.speculative --pairs 40 [--only random-words]   # the gate's cost (see gate_cost)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.compare.workloads import WORDS
from benchmarks.spec_workloads import Messages, Workload, repeated_share, workloads
from radixserve import Engine
from radixserve.forward_batch import ForwardBatch
from radixserve.model import cpu_select


@dataclass
class Run:
    ids: list[int]
    tokens: int
    decode_s: float  # time after the first token
    wall_s: float


def run_once(eng: Engine, ids: list[int], load: Workload) -> Run:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": load.max_new, **load.params})
    wall = time.perf_counter() - t0
    meta = out["meta_info"]
    return Run(out["output_ids"], meta["completion_tokens"], meta["e2e_latency"] - meta["ttft"], wall)


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


def first_answer(eng: Engine) -> Callable[[Messages], str]:
    def answer(messages: Messages) -> str:
        ids = eng.apply_chat_template(messages)
        return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 200, "temperature": 0})["text"]

    return answer


def float32_check(new_tokens: int = 60) -> None:
    """Whether greedy answers are the same with speculation on and off in float32 (bf16 rounding aside)."""
    engs = {m: Engine(dtype="float32", speculative=m) for m in ("off", "ngram")}
    try:
        loads = {w.name: w for w in workloads(first_answer(engs["off"]))}
        for name in ("multi-turn", "prose-greedy"):
            ids = engs["off"].apply_chat_template(loads[name].requests[0])
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


def measure(off: Engine, on: Engine, load: Workload, reps: int) -> str:
    """One workload's row: each request warmed into both caches, then off/on interleaved (order alternating per
    request and repetition), one stream."""
    prompts = [off.apply_chat_template(m) for m in load.requests]
    for ids in prompts:
        for eng in (off, on):  # warm the cache with the prompt, so both measure decode over a cached prefix
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    before = spec_counts(on)
    runs: dict[str, list[Run]] = {"off": [], "on": []}
    for rep in range(reps):
        for i, ids in enumerate(prompts):
            order = (("off", off), ("on", on)) if (rep + i) % 2 == 0 else (("on", on), ("off", off))
            for label, eng in order:
                runs[label].append(run_once(eng, ids, load))
    proposed, accepted, steps = (x - y for x, y in zip(spec_counts(on), before))
    return row(load, sum(map(len, prompts)) // len(prompts), runs, proposed, accepted, steps)


def random_words(n: int = 6, words: int = 60) -> Workload:
    """Requests to continue lists of random words, sampled at temperature 1 without top-p/top-k: answers with
    nothing to copy from their prompt or from themselves, so drafts are rare and almost never accepted (where the
    gate must cost nothing; the sampled prose above still repeats enough for drafts to pay now and then)."""
    rng = random.Random(7)
    asks = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]
    msgs = [[{"role": "user", "content": f"Continue this list of unrelated words: {a}"}] for a in asks]
    return Workload("random-words", msgs, 160, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True})


def gate_cost(off: Engine, on: Engine, load: Workload, pairs: int) -> None:
    """What `auto` costs where drafts do not pay: `pairs` requests to each engine, order alternating per pair
    (off/on, on/off, ...), each pair one prompt warmed into both caches; prints the per-pair ratio of decode tokens/s
    (on / off) as median and quartiles, so one slow time slice moves one pair, not the figure."""
    prompts = [off.apply_chat_template(m) for m in load.requests]
    for ids in prompts:
        for eng in (off, on):
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    before = spec_counts(on)
    ratios, rates = [], {"off": [], "on": []}
    for i in range(pairs):
        ids = prompts[i % len(prompts)]
        got = {}
        for label, eng in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
            r = run_once(eng, ids, load)
            got[label] = (r.tokens - 1) / max(r.decode_s, 1e-9)
            rates[label].append(got[label])
        ratios.append(got["on"] / got["off"])
    proposed, accepted, steps = (x - y for x, y in zip(spec_counts(on), before))
    q = statistics.quantiles(ratios, n=4)
    print(
        f"{load.name}, {pairs} pairs of {load.max_new} tokens: decode tok/s median off {statistics.median(rates['off']):.1f}"
        f" on {statistics.median(rates['on']):.1f}; per-pair on/off median {statistics.median(ratios):.3f}x "
        f"(quartiles {q[0]:.3f}-{q[2]:.3f}, mean {statistics.mean(ratios):.3f}); verify steps {steps}, drafted "
        f"{proposed}, accepted {accepted}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="--speculative-max-tokens of the 'on' engine")
    ap.add_argument("--mode", default="auto", choices=["auto", "ngram"], help="--speculative of the 'on' engine")
    ap.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all)")
    ap.add_argument("--step-cost", action="store_true", help="only measure a verify step's cost by batch size")
    ap.add_argument("--float32-check", action="store_true", help="only compare greedy tokens on/off in float32")
    ap.add_argument("--pairs", type=int, default=0, help="only the gate's cost: this many off/on pairs (see gate_cost)")
    ap.add_argument("--quantization", default="auto", help="both engines' weight format")
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
    off = Engine(speculative="off", quantization=a.quantization)
    on = Engine(speculative=a.mode, speculative_max_tokens=a.max_tokens, quantization=a.quantization)
    info = off.model_info()
    print(
        f"model={info['model_name']} dtype={info['dtype']} quantization={info['quantization']} "
        f"on: speculative={a.mode} speculative_max_tokens={a.max_tokens}"
    )
    try:
        if a.pairs:
            only = a.only or ["prose-sampled"]
            for load in [*workloads(first_answer(off)), random_words()]:
                if load.name in only:
                    gate_cost(off, on, load, a.pairs)
            return
        print(
            "| workload | requests | prompt tokens (mean) | answer tokens (off / on) | decode tok/s off | on | ratio | "
            "end-to-end tok/s off | on | ratio | acceptance | mean accepted length | repeated 4-grams (off / on) | "
            "same tokens |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for load in workloads(first_answer(off)):
            if not a.only or load.name in a.only:
                print(measure(off, on, load, a.reps), f"load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        off.shutdown()
        on.shutdown()


def row(load: Workload, prompt_len: int, runs: dict[str, list[Run]], proposed: int, accepted: int, steps: int) -> str:
    def rate(label: str, attr: str) -> float:  # tokens over summed time: every request weighs by its length
        rs = runs[label]
        tokens = sum(r.tokens - 1 for r in rs) if attr == "decode_s" else sum(r.tokens for r in rs)
        return tokens / max(sum(getattr(r, attr) for r in rs), 1e-9)

    d_off, d_on, e_off, e_on = (
        rate("off", "decode_s"),
        rate("on", "decode_s"),
        rate("off", "wall_s"),
        rate("on", "wall_s"),
    )
    if load.sampled:
        same = "n/a (sampled)"
    else:
        pairs = list(zip(runs["off"], runs["on"]))
        diverge = [next((i for i, (x, y) in enumerate(zip(p.ids, q.ids)) if x != y), None) for p, q in pairs]
        diverge += [min(len(p.ids), len(q.ids)) for p, q in pairs if len(p.ids) != len(q.ids)]
        first = [d for d in diverge if d is not None]
        same = "yes" if not first else f"no: {len(first)} of {len(pairs)} differ, first from token {min(first)}"
    tokens = {k: sum(r.tokens for r in v) // len(v) for k, v in runs.items()}
    rep = {k: statistics.mean(repeated_share(r.ids) for r in v) for k, v in runs.items()}
    share = accepted / proposed if proposed else 0.0
    mean_len = (accepted + steps) / steps if steps else 0.0
    return (
        f"| {load.name} | {len(load.requests)} | {prompt_len} | {tokens['off']} / {tokens['on']} | {d_off:.1f} | "
        f"{d_on:.1f} | {d_on / d_off:.2f}x | {e_off:.1f} | {e_on:.1f} | {e_on / e_off:.2f}x | "
        f"{share:.0%} ({accepted}/{proposed}) | {mean_len:.2f} | {rep['off']:.0%} / {rep['on']:.0%} | {same} |"
    )


if __name__ == "__main__":
    main()
