"""Sampler: greedy, seeded reproducibility inside any batch, filters, penalties and logprobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from radixserve.sampling.info import SeenIds
from radixserve.sampling.penalties import apply_penalties, penalised
from radixserve.sampling.speculative import row_infos
from radixserve.sampling.sampler import (
    TOP_P_CANDIDATES,
    SamplingInfo,
    _top_p_filter,
    greedy_ids,
    make_generator,
    sample,
    token_logprobs,
)
from radixserve.sampling_params import SamplingParams

V = 64


def info(
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    top_logprobs_num: int = 0,
    return_logprob: bool = False,
    **params: object,
) -> SamplingInfo:
    sp = SamplingParams.from_dict({**params, "seed": seed})
    gen = make_generator(seed) if seed is not None else None
    return SamplingInfo(sp, gen, output or [], prompt or [], top_logprobs_num, return_logprob)


def rand_logits(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    # rounded through bfloat16 like real model logits, so exact ties occur at filter boundaries
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16().float()


def test_greedy_is_argmax_and_uses_no_rng() -> None:
    logits = rand_logits(6, 0)
    rows = [
        info(temperature=0.0),
        info(seed=5, temperature=0.0),
        info(seed=6, top_k=1),
        info(temperature=0.0, top_p=0.5),
        info(seed=7, top_k=1, temperature=2.0),
        info(temperature=0.0, min_p=0.3),
    ]
    states = [r.generator.get_state() for r in rows if r.generator is not None]
    out = sample(logits, rows)
    assert out.next_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert all(torch.equal(s, r.generator.get_state()) for s, r in zip(states, [r for r in rows if r.generator]))


def test_greedy_ids_are_torchs_argmax() -> None:
    """numpy's argmax on CPU float32 gives torch's ids: the first of tied maxima, a NaN as the maximum (the first of
    several), a row of -inf its first id; rows strided or not; other dtypes go to torch itself."""
    logits = rand_logits(6, 3, vocab=151_936)  # bfloat16-rounded: ties among the best occur
    logits[0, [5, 900]] = 100.0
    logits[1, [7, 9]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [11, 12]] = float("inf")
    for x in (logits, logits[::2], logits[:, 1:], logits.bfloat16()):
        ours = greedy_ids(x)
        assert ours.dtype == torch.long and torch.equal(ours, x.argmax(-1))
    assert greedy_ids(logits)[:4].tolist() == [5, 7, 0, 11]


def test_top_k_1_equals_greedy_inside_a_random_batch() -> None:
    logits = rand_logits(4, 1)
    rows = [info(seed=1, top_k=1, temperature=1.5), info(seed=2), info(seed=3, top_k=1, top_p=0.3), info(seed=4)]
    out = sample(logits, rows)
    assert out.next_ids[0] == logits[0].argmax().item()
    assert out.next_ids[2] == logits[2].argmax().item()


SEEDED_SETTINGS = [
    {"temperature": 0.8},
    {"temperature": 1.0, "top_k": 7},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.2, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
]
OTHERS = [
    {"temperature": 1.0},
    {"temperature": 0.0},
    {"temperature": 0.5, "top_p": 0.5},
    {"temperature": 1.3, "top_k": 3},
    {"temperature": 1.0, "min_p": 0.2, "presence_penalty": 1.0},
]


@pytest.mark.parametrize("settings", SEEDED_SETTINGS)
def test_seeded_row_same_alone_and_in_any_batch(settings: dict) -> None:
    steps, seed = 16, 1234

    def run(batch_size: int, position: int, mix: int) -> list[int]:
        row = info(seed=seed, prompt=[1, 2, 3], **settings)
        others = [
            info(seed=(100 + mix * 10 + j) if j % 2 else None, **OTHERS[(j + mix) % len(OTHERS)])
            for j in range(batch_size - 1)
        ]
        rows = others[:position] + [row] + others[position:]
        tokens = []
        for step in range(steps):
            logits = rand_logits(batch_size, 10_000 + step)
            logits[position] = rand_logits(1, step)[0]  # the seeded row sees the same logits in every run
            tokens.append(sample(logits, rows).next_ids[position])
            row.output_ids = [*row.output_ids, tokens[-1]]
        return tokens

    alone = run(1, 0, 0)
    assert run(5, 2, 1) == alone
    assert run(8, 7, 2) == alone
    assert run(3, 0, 3) == alone
    assert len(set(alone)) > 1  # actually random
    other_seed = info(seed=seed + 1, **settings)
    assert [sample(rand_logits(1, s), [other_seed]).next_ids[0] for s in range(steps)] != alone


def empirical(logits_row: torch.Tensor, n: int, **params: object) -> torch.Tensor:
    """Frequencies of n draws (one batch of n rows, each seeded) for one row of logits."""
    rows = [info(seed=i, **params) for i in range(n)]
    ids = sample(logits_row.expand(n, -1).contiguous(), rows).next_ids
    return torch.bincount(torch.tensor(ids), minlength=logits_row.numel()).float() / n


def close_to(freq: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    # 5 standard deviations of a binomial frequency, per token
    return bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-9).all())


N_DRAWS = 4000


def test_temperature_follows_softmax() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    freq = empirical(logits, N_DRAWS, temperature=0.7)
    assert close_to(freq, (logits / 0.7).softmax(-1), N_DRAWS)


def test_top_k_never_picks_filtered_token() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(4))
    keep = logits.topk(5).indices
    freq = empirical(logits, N_DRAWS, top_k=5)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[keep] = True
    assert freq[~mask].sum() == 0
    expected = torch.where(mask, logits, torch.tensor(float("-inf"))).softmax(-1)
    assert close_to(freq, expected, N_DRAWS)


def test_top_p_never_picks_filtered_token() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    n_keep = int((sorted_p.cumsum(0) < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    mask = torch.zeros(V, dtype=torch.bool)
    mask[order[:n_keep]] = True
    freq = empirical(logits, N_DRAWS, top_p=0.6)
    assert freq[~mask].sum() == 0
    assert close_to(freq, torch.where(mask, probs, 0.0) / probs[mask].sum(), N_DRAWS)


def test_min_p_never_picks_filtered_token() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(6)) * 2
    probs = logits.softmax(-1)
    mask = probs >= 0.1 * probs.max()
    assert 1 < int(mask.sum()) < V
    freq = empirical(logits, N_DRAWS, min_p=0.1)
    assert freq[~mask].sum() == 0
    assert close_to(freq, torch.where(mask, probs, 0.0) / probs[mask].sum(), N_DRAWS)


def test_top_k_then_top_p_combined() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2
    top = logits.topk(10)
    renorm = top.values.softmax(-1)  # top_p applies to the top-k renormalised distribution
    n_keep = int((renorm.cumsum(0) < 0.5).sum()) + 1
    allowed = set(top.indices[:n_keep].tolist())
    freq = empirical(logits, 1000, top_k=10, top_p=0.5, temperature=1.0)
    assert set(torch.nonzero(freq).flatten().tolist()) <= allowed


def test_frequency_and_presence_penalties_openai_semantics() -> None:
    logits = rand_logits(2, 8)
    rows = [info(frequency_penalty=0.5, presence_penalty=0.25, output=[3, 3, 3, 9], prompt=[4, 4]), info()]
    before = logits.clone()
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, before)  # input untouched
    expected = before.clone()
    expected[0, 3] -= 3 * 0.5 + 0.25
    expected[0, 9] -= 1 * 0.5 + 0.25
    assert torch.allclose(out, expected)  # prompt tokens (4) are not penalised, row 1 unchanged


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [info(repetition_penalty=2.0, prompt=[0, 1], output=[1, 3])])
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5]]))


def test_repetition_penalty_on_numpy_equals_torch() -> None:
    # Contiguous float32 CPU logits take the numpy view (penalties.py, _repetition); a non-contiguous copy of the same
    # values takes torch's index ops row by row. Both must give the same bits, at penalties either side of 1.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4000, generator=g) * 20
    rows = [
        info(repetition_penalty=1.1, prompt=list(range(0, 4000, 3)), output=[1, 2, 7]),
        info(repetition_penalty=0.7, prompt=list(range(1, 4000, 7))),
        info(repetition_penalty=1.1, prompt=[5, 9, 3999]),
    ]
    strided = logits.t().contiguous().t()  # the same values, not contiguous
    assert logits.is_contiguous() and not strided.is_contiguous()
    out = apply_penalties(logits, rows)
    assert not torch.equal(out, logits)
    assert torch.equal(out, apply_penalties(strided, rows))


def test_repetition_penalty_kept_ids_match_a_rebuild_every_step() -> None:
    # A request's SeenIds grows with its live output list; each step must penalise exactly what a fresh set would,
    # ids at or above the head's vocabulary (a larger tokenizer) included only once they fit.
    prompt = [3, 3, 60, 70, 5]
    kept, fresh = info(repetition_penalty=1.7, prompt=prompt), info(repetition_penalty=1.7, prompt=prompt)
    kept.seen = SeenIds(prompt)
    other = info(repetition_penalty=1.3, prompt=[1, 2])
    other.seen = SeenIds([1, 2])
    for step, new in enumerate([9, 9, 3, 63, 12, 0]):
        logits = rand_logits(2, 500 + step)
        expected = apply_penalties(
            logits, [fresh, info(repetition_penalty=1.3, prompt=[1, 2], output=other.output_ids)]
        )
        assert torch.equal(apply_penalties(logits, [kept, other]), expected)
        for row in (kept, fresh):
            row.output_ids.append(new)
        other.output_ids.append(new + 1)
    wide = rand_logits(1, 7, vocab=80)
    assert torch.equal(apply_penalties(wide, [kept]), apply_penalties(wide, [fresh]))  # 70 penalised now
    assert not torch.equal(apply_penalties(wide, [kept])[0, 70], wide[0, 70])


def test_verify_rows_count_their_drafts_without_keeping_them() -> None:
    # Verify rows share the request's SeenIds: row i penalises draft[:i] as output, and none of it stays kept.
    prompt = [3, 5, 60]
    kept = info(repetition_penalty=1.5, prompt=prompt, output=[7, 3])
    kept.seen = SeenIds(prompt)
    fresh = info(repetition_penalty=1.5, prompt=prompt, output=[7, 3])
    draft = [9, 7, 11, 9]
    rows = [replace(fresh, output_ids=[*fresh.output_ids, *draft[:i]]) for i in range(len(draft) + 1)]
    logits = rand_logits(len(draft) + 1, 3)
    assert torch.equal(apply_penalties(logits, row_infos(kept, draft)), apply_penalties(logits, rows))
    for row in (kept, fresh):  # the first draft accepted; 11 was only ever a draft
        row.output_ids.append(9)
    one = rand_logits(1, 4)
    assert torch.equal(apply_penalties(one, [kept]), apply_penalties(one, [fresh]))


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    assert sample(logits, [info(temperature=0.0)]).next_ids == [10]
    assert sample(logits, [info(temperature=0.0, presence_penalty=1.5, output=[10])]).next_ids == [11]
    assert sample(logits, [info(temperature=0.0, repetition_penalty=1.5, prompt=[10])]).next_ids == [11]


def test_penalised_writes_in_place_and_puts_every_value_back() -> None:
    # sample_ids penalises the caller's logits in place (no copy of the vocabulary a step) and restores them, on an
    # error too; inside the block they equal apply_penalties' copy, for every mix of rows and penalty kinds.
    def rows() -> list[SamplingInfo]:  # greedy, so that sample() must pick the penalised argmax
        return [
            info(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 2, 70], output=[5, 1]),  # 70: past the head
            info(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2, output=[3, 3, 9]),
            info(temperature=0.0),
            info(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5, prompt=[4], output=[4, 6, 6]),
        ]

    for pick in ([0, 1, 2, 3], [1], [0, 1], [3, 1]):
        batch = [rows()[i] for i in pick]
        logits = rand_logits(len(batch), 12)
        logits[:, :10] += 8.0  # the penalised ids lead, so the penalties move the argmax
        before = logits.clone()
        expected = apply_penalties(logits, batch)
        assert not torch.equal(expected, before)
        with penalised(logits, batch) as scored:
            assert scored is logits and torch.equal(scored, expected)
        assert torch.equal(logits, before)
        with pytest.raises(RuntimeError), penalised(logits, batch):
            raise RuntimeError("a row failed")
        assert torch.equal(logits, before)
        assert sample(logits, batch).next_ids == expected.argmax(-1).tolist()
        assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8},  # the default model's publisher settings
        {"temperature": 1.0, "top_k": 7},
        {"temperature": 0.3, "top_k": 50, "min_p": 0.05},
        {"temperature": 1.7, "top_k": 3, "top_p": 0.5, "min_p": 0.01},
        {"temperature": 0.9, "top_k": 128},
    ],
)
def test_top_k_candidates_draw_what_the_full_vocabulary_path_draws(settings: dict) -> None:
    # bfloat16-rounded logits tie at the k-th value often; the candidates must keep exactly the ties the full
    # path keeps, and the draw land on the same id for the same uniform.
    from radixserve.sampling.candidates import sample_candidates
    from radixserve.sampling.sampler import _sample_full

    params = info(**settings).params
    gen = torch.Generator().manual_seed(5)
    for trial in range(150):
        row = (torch.randn(70_037, generator=gen) * (0.5 + trial % 7)).bfloat16().float()  # a tail past the blocks
        if trial % 5 == 0:
            row[:40] = row.max()  # a tie at the top wider than k for small k
        if trial % 5 == 1:  # an id one ulp under the k-th: within the candidates' margin, and never kept
            kth = row.topk(params.top_k).values[-1:]
            row[row.argmin()] = torch.nextafter(kth, torch.tensor([-1e30]))
        u = torch.rand(1, generator=gen).clamp_(max=1.0 - 2.0**-22)
        full = _sample_full(row[None, :], [info(**settings)], u).item()
        assert sample_candidates(row, params, float(u)) == full


def test_logprobs_are_raw_log_softmax() -> None:
    logits = rand_logits(3, 9)
    rows = [
        info(seed=1, temperature=0.5, top_k=3, return_logprob=True, frequency_penalty=1.0, output=[1, 2]),
        info(temperature=0.0, top_logprobs_num=4),
        info(seed=2),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(out.next_ids)], abs=1e-6)
    assert out.top_logprobs[0] == [] and out.top_logprobs[2] == []
    vals, ids = ref[1].topk(4)
    assert [t for _, t in out.top_logprobs[1]] == ids.tolist()
    assert [lp for lp, _ in out.top_logprobs[1]] == pytest.approx(vals.tolist(), abs=1e-6)


def test_token_logprobs_for_prompts() -> None:
    logits = rand_logits(5, 10)
    targets = torch.tensor([0, 5, 63, 7, 7])
    chosen, top = token_logprobs(logits, targets, top_k=2)
    ref = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx(ref[torch.arange(5), targets].tolist(), abs=1e-6)
    assert [[t for _, t in row] for row in top] == ref.topk(2).indices.tolist()
    assert token_logprobs(logits, targets, top_k=0)[1] == [[]] * 5


def test_make_generator_and_bad_batch() -> None:
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()
    assert make_generator(7).initial_seed() == 7
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, V), [info()])


def test_top_p_candidates_and_full_sort_fallback_match_reference() -> None:
    # vocab > TOP_P_CANDIDATES: peaked rows find the cut among the candidates, flat rows need the full sort
    vocab = TOP_P_CANDIDATES * 4
    scales = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.3, 0.05, 0.0, 6.0])[:, None]
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(11)) * scales).bfloat16().float()
    top_ps = [0.9, 0.5, 0.95, 0.8, 0.7, 0.99, 0.5, 1.0]
    got = _top_p_filter(logits, top_ps).isfinite()
    for i, p in enumerate(top_ps):
        vals, order = logits[i].sort(descending=True)
        probs = logits[i].softmax(-1)[order]
        kept = (probs.cumsum(0) - probs) < p if p < 1 else torch.ones(vocab, dtype=torch.bool)
        cut = vals[kept].min()
        assert torch.equal(got[i], logits[i] >= cut), i
    assert got[6].all()  # all ties: the nucleus keeps every id tied with its last one
    assert 0 < int(got[0].sum()) < TOP_P_CANDIDATES < int(got[4].sum())  # both paths were exercised


def test_seeded_rows_with_large_vocab_same_alone_and_in_batch() -> None:
    vocab = TOP_P_CANDIDATES * 3
    settings = [
        {"top_p": 0.9},
        {"top_p": 0.95, "temperature": 3.0},
        {"top_k": 600, "top_p": 0.97},
        {"min_p": 0.01, "temperature": 2.0},
    ]
    logits = rand_logits(len(settings), 21, vocab)
    logits[0] *= 4  # peaked: cut among candidates; the hot rows need the full sort
    for _ in range(3):
        batch = sample(logits, [info(seed=50 + j, **s) for j, s in enumerate(settings)]).next_ids
        alone = [sample(logits[j : j + 1], [info(seed=50 + j, **s)]).next_ids[0] for j, s in enumerate(settings)]
        assert batch == alone
        logits = logits.roll(1, dims=1)


def test_penalties_ignore_ids_outside_the_logits() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    out = apply_penalties(
        logits,
        [info(repetition_penalty=2.0, prompt=[7, -1, 0], output=[5], frequency_penalty=1.0, presence_penalty=0.5)],
    )
    assert torch.allclose(out, torch.tensor([[0.5, -1.0, 2.0]]))
    out = apply_penalties(logits, [info(frequency_penalty=1.0, output=[9, 9])])
    assert torch.equal(out, logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_seeded_rows_and_filters_hold() -> None:
    vocab = TOP_P_CANDIDATES * 8
    logits = rand_logits(6, 31, vocab).cuda()
    logits[0] *= 5
    settings = [
        {"top_p": 0.9},
        {"top_p": 0.95, "temperature": 2.0},
        {"top_k": 40},
        {"min_p": 0.05},
        {"temperature": 0.0},
        {"temperature": 0.8, "frequency_penalty": 1.0, "repetition_penalty": 1.3},
    ]

    def rows() -> list[SamplingInfo]:
        return [info(seed=70 + j, output=[1, 2, 2], prompt=[3], **s) for j, s in enumerate(settings)]

    batch = sample(logits, rows()).next_ids
    alone = [sample(logits[j : j + 1], [r]).next_ids[0] for j, r in enumerate(rows())]
    assert batch == alone
    assert batch[4] == logits[4].argmax().item()
    assert batch[2] in logits[2].topk(40).indices.tolist()
    probs = logits[3].softmax(-1)
    assert probs[batch[3]] >= 0.05 * probs.max()
