"""Greedy tokens of a config against a reference config, and whether each place they part is a near-tie (issue 38).

The issue asks that the default model's greedy tokens over the GGUF's blocks equal those of a reference that
dequantizes the same blocks to float32 (`float32:none`), except where the reference's top-2 gap is within the
measured noise of the activation rounding. This measures both sides of that sentence:

- the noise of a choice: how far the config moves the reference's top-2 gap (its log-prob of its top token minus
  that of its runner-up, against the config's log-probs of the same two tokens). A greedy choice flips exactly when
  that move exceeds the gap. Measured two ways: on the decode path, from both greedy runs' own log-probs (each
  token as it was chosen) at every token before the two answers part; and teacher-forced, every token of the
  reference's answers scored under both configs with the same context in one prefill (`logprob_start_len` at the
  answer), the partings themselves left out. Median, 99th percentile and largest of each, and the plain
  |d log-prob| of the reference's tokens teacher-forced;
- the partings: for each prompt whose greedy answer leaves the reference's at token i, the reference's top-2 gap
  there both ways. A parting is within the noise when the reference's gap as it chose is at most the largest move
  measured on the decode path: decode and a prefill run different attention kernels, so a near-tie can part on
  one path and not on the other.

Greedy here turns the publisher's repetition penalty off (`repetition_penalty` 1.0): with it, the greedy token is not
the top of the unpenalized log-probs that teacher forcing returns. Prompts and answer length are benchmarks.quality's.

    .venv/bin/python -m benchmarks.near_ties [--reference float32:none] [--configs float32:gguf bfloat16:gguf]
        [--prompts 20]

A config's third field `deterministic` runs it in deterministic mode (radixserve/model/deterministic.py); without
it a config runs the engine's default, which turns that mode on for a GGUF on AVX512_BF16 CPUs: there the default is
`bfloat16:gguf:deterministic`. In that mode decode, a prefill and a speculative check give a token the same
log-probs, so the decode path and teacher forcing measure the same thing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.quality import AGREE_TOKENS, PROMPTS, leading_match  # noqa: E402
from benchmarks.quant_engine import cpu_flags  # noqa: E402
from radixserve import Engine  # noqa: E402

GREEDY = {"max_new_tokens": AGREE_TOKENS, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.0}
NEAR = 1.0  # a reference gap (nats) under which the decode path's moves are also reported apart: the near-ties
TOP = 20  # log-probs returned per scored token: enough that the config's list holds the reference's runner-up


@dataclass
class Scored:
    """One config's greedy answers with its log-probs as it chose them (decode path), and its log-probs over the
    reference's answers (teacher-forced)."""

    answers: list[list[int]]
    decoded: list[list[list[tuple[float, int]]]]  # [prompt][i]: the TOP most likely tokens at its own token i
    lp: list[list[float]]  # [prompt][i]: log-prob of the reference's token i
    top: list[list[list[tuple[float, int]]]]  # [prompt][i]: the TOP most likely tokens at i, (log-prob, id)


def rows(entries: list[list[Any]]) -> list[list[tuple[float, int]]]:
    return [[(float(v), int(t)) for v, t, *_ in row] for row in entries]


def run_config(conf: str, questions: list[str], reference: list[list[int]] | None) -> tuple[list[list[int]], Scored]:
    """Greedy answers under `conf` (dtype:quantization, or dtype:quantization:deterministic), then the reference's
    answers scored (its own if None); with the chat prompts' ids."""
    dtype, quant, *mode = conf.split(":")
    assert mode in ([], ["deterministic"]), f"{conf}: the third field can only be 'deterministic'"
    with Engine(dtype=dtype, quantization=quant, deterministic=True if mode else None, max_total_tokens=8192) as eng:
        prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=TOP)
        answers = [o["output_ids"][:AGREE_TOKENS] for o in outs]
        decoded = [rows(o["meta_info"]["output_top_logprobs"])[:AGREE_TOKENS] for o in outs]
        lp, top = [], []
        for ids, answer in zip(prompts, reference or answers):
            meta = eng.generate(
                input_ids=ids + answer,
                sampling_params={"max_new_tokens": 1, "temperature": 0},
                return_logprob=True,
                logprob_start_len=len(ids),
                top_logprobs_num=TOP,
            )["meta_info"]
            lp.append([v for v, _ in meta["input_token_logprobs"]])
            top.append(rows(meta["input_top_logprobs"]))
    return prompts, Scored(answers, decoded, lp, top)


def parting(run: Scored, ref: Scored, p: int) -> int | None:
    """The token at which prompt p's greedy answer leaves the reference's, or None."""
    i = leading_match(run.answers[p], ref.answers[p])
    return i if i < AGREE_TOKENS else None


def gap(row: list[tuple[float, int]], token: int) -> float:
    """The top-2 gap of a row of log-probs whose top should be `token`; 0 where it is not."""
    (top1, top1_id), (top2, _) = row[:2]
    return top1 - top2 if top1_id == token else 0.0


def gap_move(ref_row: list[tuple[float, int]], token: int, run_row: list[tuple[float, int]]) -> float | None:
    """How far a config's log-probs moved the reference's top-2 gap, where the reference's top is its `token` (None
    where it is not, or where the config's list lacks one of the two)."""
    (top1, top1_id), (top2, top2_id) = ref_row[:2]
    theirs = {t: v for v, t in run_row}
    if top1_id != token or top1_id not in theirs or top2_id not in theirs:
        return None
    return abs((top1 - top2) - (theirs[top1_id] - theirs[top2_id]))


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 99th percentile, largest); zeros for none."""
    d = sorted(values) or [0.0]
    return statistics.median(d), d[int(0.99 * (len(d) - 1))], d[-1]


def ratio(value: float, largest: float) -> str:
    return f"{value / largest:.1f}x the largest move" if largest else "no move measured"


def report(conf: str, ref: Scored, run: Scored) -> list[str]:
    """The noise lines and one line per parting."""
    where = {
        (p, i): abs(a - b) for p, (la, lb) in enumerate(zip(run.lp, ref.lp)) for i, (a, b) in enumerate(zip(la, lb))
    }
    at = max(where, key=where.__getitem__)
    med, p99, largest = spread(list(where.values()))
    partings = {p: i for p in range(len(run.answers)) if (i := parting(run, ref, p)) is not None}
    forced = [
        m
        for p, i in where
        if partings.get(p) != i and (m := gap_move(ref.top[p][i], ref.answers[p][i], run.top[p][i])) is not None
    ]
    # Decode path: the two greedy runs saw the same tokens up to a parting, so their own log-probs compare there.
    decode = {
        (p, i): m
        for p in range(len(run.answers))
        for i in range(partings.get(p, AGREE_TOKENS))
        if (m := gap_move(ref.decoded[p][i], ref.answers[p][i], run.decoded[p][i])) is not None
    }
    near = [m for (p, i), m in decode.items() if gap(ref.decoded[p][i], ref.answers[p][i]) < NEAR]
    fmed, fp99, fmax = spread(forced)
    dmed, dp99, dmax = spread(list(decode.values()))
    nmed, np99, nmax = spread(near)
    lines = [
        f"{conf}: |d log-prob| over {len(where)} reference tokens (teacher-forced): median {med:.4f}, p99 {p99:.4f}, "
        f"largest {largest:.4f} (prompt {at[0]}, token {at[1]})",
        f"{conf}: top-2 gap moved, teacher-forced, over {len(forced)} tokens (not the partings): median {fmed:.4f}, "
        f"p99 {fp99:.4f}, largest {fmax:.4f}",
        f"{conf}: top-2 gap moved, decode path, over {len(decode)} tokens (before the partings): median {dmed:.4f}, "
        f"p99 {dp99:.4f}, largest {dmax:.4f}; of those, the {len(near)} where the reference's gap is under {NEAR}: "
        f"median {nmed:.4f}, p99 {np99:.4f}, largest {nmax:.4f}",
    ]
    within_decode = within_forced = 0
    for p, i in partings.items():
        token = ref.answers[p][i]
        dgap, fgap = gap(ref.decoded[p][i], token), gap(ref.top[p][i], token)
        within_decode += dgap <= dmax
        within_forced += fgap <= fmax
        prefers = run.top[p][i][0][0] - run.lp[p][i]
        lines.append(
            f"  prompt {p}: parts at token {i}: reference gap decoding {dgap:.4f} ({ratio(dgap, dmax)}), "
            f"teacher-forced {fgap:.4f} ({ratio(fgap, fmax)}); teacher-forced, {conf}'s top is {prefers:.4f} above the "
            "reference's token"
        )
    lines.append(
        f"  {len(run.answers) - len(partings)}/{len(run.answers)} prompts equal for all {AGREE_TOKENS} tokens; of "
        f"{len(partings)} partings, {within_decode} within the noise of the decode path (the reference's gap as it "
        f"chose <= the largest move there), {within_forced} teacher-forced"
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
