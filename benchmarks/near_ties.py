"""Greedy tokens of a config against a reference config, and whether each place they part is a near-tie (issue 38).

The issue asks that the default model's greedy tokens over the GGUF's blocks equal those of a reference that
dequantizes the same blocks to float32 (`float32:none`), except where the reference's top-2 gap is within the
measured noise of the activation rounding. This measures both sides of that sentence:

- the noise: every token of the reference's greedy answers is scored under both configs with the same context
  (teacher-forced: prompt + the reference's answer, `logprob_start_len` at the answer), and the per-token
  |d log-prob| between them is the rounding's effect (median, 99th percentile, largest);
- the partings: for each prompt whose greedy answer leaves the reference's at token i, the reference's own top-2
  gap at i (its log-prob of its token minus that of the runner-up) and the config's preference there (its top
  log-prob minus that of the reference's token). A parting is within the noise when the reference's gap is at most
  twice the largest |d| measured: two tokens' log-probs each moved by up to that much can swap such a pair. The
  largest |d| may sit at a parting itself, so the count within twice the 99th percentile is printed too.

Greedy here turns the publisher's repetition penalty off (`repetition_penalty` 1.0): with it, the greedy token is not
the top of the unpenalized log-probs that teacher forcing returns. Prompts and answer length are benchmarks.quality's.

    .venv/bin/python -m benchmarks.near_ties [--reference float32:none] [--configs float32:gguf bfloat16:gguf]
        [--prompts 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from benchmarks.quality import AGREE_TOKENS, PROMPTS, leading_match  # noqa: E402
from benchmarks.quant_engine import cpu_flags  # noqa: E402
from radixserve import Engine  # noqa: E402

GREEDY = {"max_new_tokens": AGREE_TOKENS, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.0}


@dataclass
class Scored:
    """One config's greedy answers, and its log-probs over the reference's answers (teacher-forced)."""

    answers: list[list[int]]
    lp: list[list[float]]  # [prompt][i]: log-prob of the reference's token i
    top: list[list[list[tuple[float, int]]]]  # [prompt][i]: the two most likely tokens at i, (log-prob, id)


def run_config(conf: str, questions: list[str], reference: list[list[int]] | None) -> tuple[list[list[int]], Scored]:
    """Greedy answers under `conf` (dtype:quantization), then the reference's answers scored (its own if None);
    with the chat prompts' ids."""
    dtype, quant = conf.split(":")
    with Engine(dtype=dtype, quantization=quant, max_total_tokens=8192) as eng:
        prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        answers = [o["output_ids"][:AGREE_TOKENS] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        lp, top = [], []
        for ids, answer in zip(prompts, reference or answers):
            meta = eng.generate(
                input_ids=ids + answer,
                sampling_params={"max_new_tokens": 1, "temperature": 0},
                return_logprob=True,
                logprob_start_len=len(ids),
                top_logprobs_num=2,
            )["meta_info"]
            lp.append([v for v, _ in meta["input_token_logprobs"]])
            top.append([[(float(v), int(t)) for v, t, *_ in row] for row in meta["input_top_logprobs"]])
    return prompts, Scored(answers, lp, top)


def report(conf: str, ref: Scored, run: Scored) -> list[str]:
    """The noise line and one line per parting."""
    where = {
        (p, i): abs(a - b) for p, (la, lb) in enumerate(zip(run.lp, ref.lp)) for i, (a, b) in enumerate(zip(la, lb))
    }
    d = sorted(where.values())
    at = max(where, key=where.__getitem__)
    noise, p99 = where[at], d[int(0.99 * (len(d) - 1))]
    lines = [
        f"{conf}: |d log-prob| over {len(d)} reference tokens: median {statistics.median(d):.4f}, "
        f"p99 {p99:.4f}, largest {noise:.4f} (prompt {at[0]}, token {at[1]})"
    ]
    partings = within = within_p99 = 0
    for p, (ours, theirs) in enumerate(zip(run.answers, ref.answers)):
        i = leading_match(ours, theirs)
        if i >= AGREE_TOKENS:
            continue
        partings += 1
        (top1, top1_id), (top2, _) = ref.top[p][i]
        # Scored in one prefill, the reference's token may not be its own top (its greedy ran decode steps): gap 0.
        own_top = top1_id == theirs[i]
        gap = top1 - top2 if own_top else 0.0
        prefers = run.top[p][i][0][0] - run.lp[p][i]
        within += gap <= 2 * noise
        within_p99 += gap <= 2 * p99
        lines.append(
            f"  prompt {p}: parts at token {i}: reference gap {gap:.4f} ({gap / noise:.1f}x the largest |d|)"
            + ("" if own_top else " (its greedy token is not its top-1 when scored)")
            + f", {conf} prefers its token by {prefers:.4f}"
        )
    lines.append(
        f"  {len(run.answers) - partings}/{len(run.answers)} prompts equal for all {AGREE_TOKENS} tokens; "
        f"{within} of {partings} partings within the noise (reference gap <= 2x the largest |d|), "
        f"{within_p99} within 2x its p99"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", default="float32:none")
    ap.add_argument("--configs", nargs="+", default=["float32:gguf", "bfloat16:gguf"])
    ap.add_argument("--prompts", type=int, default=20, choices=range(1, len(PROMPTS) + 1), metavar="N")
    a = ap.parse_args()
    print(cpu_flags(), flush=True)
    questions = PROMPTS[: a.prompts]
    prompts, ref = run_config(a.reference, questions, None)
    for conf in a.configs:
        ids, run = run_config(conf, questions, ref.answers)
        assert ids == prompts, "the configs' tokenizers differ"
        print("\n".join(report(conf, ref, run)), flush=True)


if __name__ == "__main__":
    main()
