"""Speculative rejection sampling keeps the sampled distribution (issue 16): `verify` against the exact distribution
of a known row (torch's seed fixed: deterministic), and the engine with speculation on against the plain engine
(unseeded requests draw fresh seeds, so this one is random: a correct sampler fails it 1 time in 1,000), both by
chi-square at alpha = 1e-3."""

from __future__ import annotations

import collections
import math
import random
from pathlib import Path

import pytest
import torch

from radixserve.sampling.info import SamplingInfo
from radixserve.sampling.speculative import verify
from radixserve.sampling_params import SamplingParams
from radixserve.step import Draft

Z_999 = 3.0902  # standard normal quantile at 1 - 1e-3


def chi2_critical(df: int) -> float:
    """Chi-square quantile at 1 - 1e-3 (Wilson-Hilferty; within 1% of the exact value for df >= 2)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def goodness_of_fit(counts: collections.Counter, probs: list[float]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of `counts` against `probs` (ids of probability 0 must not occur)."""
    n = sum(counts.values())
    for tok, c in counts.items():
        assert probs[tok] > 0 or c == 0, f"id {tok} has probability 0 but was drawn {c} times"
    cells = [(counts.get(t, 0), n * p) for t, p in enumerate(probs) if p > 0]
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def info(**params: object) -> SamplingInfo:
    return SamplingInfo(params=SamplingParams(**params), generator=None, output_ids=[], prompt_ids=[])


@pytest.mark.parametrize("draft", [[2, 0], [5, 1], [1, 1]], ids=["likely", "filtered-out", "repeat"])
def test_verify_matches_the_plain_distribution(draft: list[int]) -> None:
    """Row 0's distribution for the first token; given the first draft accepted, row 1's for the second. With top_k=4
    of 6 ids, draft id 5 has probability 0 (always rejected). Seed 1: with seed 0 the 'likely' case's second token
    scores 17.3 at df 3 (a 1-in-2,000 draw; 20,000 draws then match row 1 to 0.002), seeds 1-7 score 0.4 to 7.9."""
    torch.manual_seed(1)
    logits = torch.tensor(
        [[1.0, 0.5, 2.0, -1.0, 0.0, -3.0], [0.0, 1.5, 0.2, 0.7, -0.5, -2.0], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]]
    )
    inf = info(temperature=0.8, top_k=4)
    p = [torch.softmax(torch.where(row >= row.topk(4).values[-1], row / 0.8, -math.inf), 0).tolist() for row in logits]
    first: collections.Counter = collections.Counter()
    second: collections.Counter = collections.Counter()
    n = 6000
    for _ in range(n):
        ids = verify(logits, inf, draft).ids
        first[ids[0]] += 1
        if ids[0] == draft[0]:
            second[ids[1]] += 1
    check(first, p[0])
    check(second, p[1])


def check(counts: collections.Counter, probs: list[float]) -> None:
    if sum(counts.values()) < 200:
        return  # the draft was (rightly) almost never accepted: nothing to compare
    stat, df = goodness_of_fit(counts, probs)
    assert stat < chi2_critical(df), (stat, df, counts, probs)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.4),
    ],
    ids=["top_p", "min_p", "penalties"],
)
def test_verify_matches_the_plain_sampler_under_filters_and_penalties(params: dict) -> None:
    """The first token's distribution equals what the plain sampler draws from: filter_logits of the penalised row
    (penalties count the request's output so far; row 1 also counts the accepted first draft)."""
    from radixserve.sampling.penalties import apply_penalties
    from radixserve.sampling.sampler import filter_logits
    from radixserve.sampling.speculative import row_infos

    torch.manual_seed(1)
    logits = torch.tensor(
        [[1.0, 0.5, 2.0, -1.0, 0.0, -3.0], [0.0, 1.5, 0.2, 0.7, -0.5, -2.0], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]]
    )
    inf = SamplingInfo(params=SamplingParams(**params), generator=None, output_ids=[2, 1], prompt_ids=[0])
    draft = [2, 1]
    rows = row_infos(inf, draft)
    p = filter_logits(apply_penalties(logits, rows), rows).softmax(dim=-1).tolist()
    first: collections.Counter = collections.Counter()
    second: collections.Counter = collections.Counter()
    for _ in range(4000):
        ids = verify(logits, inf, draft).ids
        first[ids[0]] += 1
        if ids[0] == draft[0]:
            second[ids[1]] += 1
    check(first, p[0])
    check(second, p[1])


def test_verify_greedy_takes_the_argmax_run() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    assert verify(logits, info(temperature=0), [1, 0]).ids == [1, 0, 2]  # both accepted, then the model's own
    assert verify(logits, info(temperature=0), [1, 2]).ids == [1, 0]  # second rejected: the correction
    assert verify(logits, info(temperature=0), [0, 0]).ids == [1]


def test_engine_sampled_distribution_unchanged(tiny_model_dir: Path, make_engine) -> None:
    """The tiny model's answers with speculation on (every step drafts two of the likeliest tokens, so acceptance and
    rejection both happen) against the plain engine: the joint distribution of tokens 2 and 3 (drawn in verify steps)
    is homogeneous by a two-sample chi-square at alpha = 1e-3 (384 answers each; cells under 10 pooled)."""
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(40)] + [171] * 8
    params = {"max_new_tokens": 3, "temperature": 0.3, "top_k": 6, "ignore_eos": True, "n": 128}
    torch.manual_seed(1234)
    off = make_engine(tiny_model_dir, speculative="off")
    on = make_engine(tiny_model_dir, speculative="ngram")
    likely = [500, 312]  # the tiny model's commonest tokens after this prompt (measured with speculation off)
    on.scheduler.drafter.propose = lambda req, room: Draft(likely[:room], "prompt") if room > 0 else None
    samples = {}
    for name, eng in (("off", off), ("on", on)):
        outs = [o for _ in range(3) for o in eng.generate(input_ids=prompt, sampling_params=params)]
        samples[name] = collections.Counter(tuple(o["output_ids"][1:3]) for o in outs)
    stats = on.cache_stats()
    assert 0 < sum(stats["spec_accepted_tokens"].values()) < sum(stats["spec_draft_tokens"].values()), stats
    a, b = samples["off"], samples["on"]
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    cells = [(a[k], b[k]) for k in keys]
    cells.append((sum(a.values()) - sum(a[k] for k in keys), sum(b.values()) - sum(b[k] for k in keys)))
    cells = [c for c in cells if sum(c) > 0]
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    df = len(cells) - 1
    assert df >= 3 and stat < chi2_critical(df), (stat, df, cells)
