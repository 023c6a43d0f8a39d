"""Batched sampler: penalties, logit bias, greedy/temperature/top-k/top-p/min-p, per-request seeded RNG, and logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.sampling.bias import apply_bias
from radixserve.sampling.candidates import nucleus_cut, sample_candidates, takes_candidates
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling.penalties import penalised
from radixserve.transfer import device_tensor

# Top-p finds its cut among this many best ids per row; a row whose nucleus is wider falls back to a full sort.
TOP_P_CANDIDATES = 512


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [B, V]: the first maximal index, a NaN counting as the maximum (torch's rule).

    On CPU float32 numpy's argmax does it: torch's took 129 us a 152k-id row and 650 us for eight (2 threads, Zen 4),
    numpy's 12 and 76, with the same ids (tests/test_sampler.py), at every decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float] | None  # raw log_softmax of each chosen token, for every row when any row asked
    # per row its top_logprobs_num (logprob, id), best first, then those of its token_ids_logprob
    top_logprobs: list[list[tuple[float, int]]] | None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on device seeded with seed (a fresh random seed when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _uniforms(infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """One uniform draw per row on the CPU, in [0, 1 - 2**-22]: from the row's generator, else torch's global RNG.

    One scalar per row keeps a seeded row's stream independent of the batch and costs no device launch per row.
    """
    u = torch.rand(len(infos)) if any(info.generator is None for info in infos) else torch.empty(len(infos))
    for j, info in enumerate(infos):
        gen = info.generator
        if gen is not None:
            # a device generator works but syncs here; make_generator's default (CPU) avoids that
            u[j] = torch.rand((), generator=gen, device=gen.device).item()
    # scaled by a float32 total, u must stay far enough below 1 that the target never rounds up to the total
    return u.clamp_(max=1.0 - 2.0**-22)


def _top_k_filter(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Mask ids below each row's k-th best logit (ties with it stay); k == 0 leaves the row alone."""
    k = device_tensor(ks, logits.device)[:, None]
    kth = logits.topk(max(ks), dim=-1).values.gather(1, k.clamp_min(1) - 1)
    kth = kth.masked_fill(k == 0, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_filter(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Mask ids outside each row's nucleus (ties with its last id stay); top_p == 1 leaves the row alone.

    The cut is looked for among a fixed number of best ids (TOP_P_CANDIDATES, so a row's arithmetic never depends on
    the batch); only rows whose nucleus is wider than that pay for a full sort.
    """
    vocab = logits.shape[1]
    top_p = device_tensor(top_ps, logits.device)[:, None]
    probs = logits.softmax(dim=-1)
    cand_logits, cand_ids = logits.topk(min(TOP_P_CANDIDATES, vocab), dim=-1)
    cut, cand_mass = nucleus_cut(cand_logits, probs.gather(1, cand_ids), top_p)
    if cand_ids.shape[1] < vocab:
        # all candidates kept and still short of top_p: the nucleus reaches past them (one sync, on these rows only)
        wide = ((cand_mass < top_p) & (top_p < 1.0)).squeeze(1).nonzero().squeeze(1)
        if wide.numel():
            sorted_logits, order = logits[wide].sort(dim=-1, descending=True)
            cut[wide] = nucleus_cut(sorted_logits, probs[wide].gather(1, order), top_p[wide])[0]
    cut = cut.masked_fill(top_p >= 1.0, float("-inf"))
    return logits.masked_fill(logits < cut, float("-inf"))


def filter_logits(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Logits [R, V] of non-greedy rows after temperature, top-k, top-p and min-p: their softmax is the distribution
    each row samples from (masked ids are -inf)."""
    vocab, device = logits.shape[1], logits.device
    params = [info.params for info in infos]
    logits = logits / device_tensor([p.temperature for p in params], device)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        logits = _top_k_filter(logits, ks)
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p_filter(logits, [p.top_p for p in params])  # on the top-k renormalised distribution, as HF
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed, and min_p = 0 masks nothing
        log_min_p = device_tensor([p.min_p for p in params], device).log()[:, None]
        logits = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))
    return logits


def _sample_rows(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Sample one id per row of logits [R, V] (all rows non-greedy): temperature, top-k, top-p, min-p, then draw.

    Every step of a row depends only on that row (fixed sizes, value thresholds; a CPU row with a top-k runs alone
    on its candidates: candidates.py), so a seeded row draws the same id whatever else is in the batch.
    """
    u = _uniforms(infos)
    ids: dict[int, int] = {}
    for j, info in enumerate(infos):
        if takes_candidates(logits, info.params):
            got = sample_candidates(logits[j], info.params, float(u[j]))
            if got is not None:
                ids[j] = got
    if not ids:
        return _sample_full(logits, infos, u)
    rest = [j for j in range(len(infos)) if j not in ids]
    out = torch.tensor([ids.get(j, 0) for j in range(len(infos))])
    if rest:
        out[rest] = _sample_full(logits[rest], [infos[j] for j in rest], u[rest])
    return out


def _sample_full(logits: torch.Tensor, infos: Sequence[SamplingInfo], u: torch.Tensor) -> torch.Tensor:
    vocab, device = logits.shape[1], logits.device
    logits = filter_logits(logits, infos)
    # Inverse CDF in vocabulary order: the first id whose running mass passes u * total. A filtered id adds no mass,
    # so it can never be the first to pass.
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    target = u.to(device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)


def sample_ids(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next id per row of logits [B, V] under that row's settings, left on logits' device (greedy and plain
    temperature sampling never wait for the device), and the raw log_softmax when any row asks for logprobs."""
    if logits.shape[0] != len(infos):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(infos)} sampling infos were given")
    logits = logits.float()
    want_logprobs = any(info.return_logprob or info.top_logprobs_num > 0 for info in infos)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    with penalised(logits, infos) as scored:  # in place, put back on exit: what is returned never aliases it
        return _choose(apply_bias(scored, infos), infos), raw_logprobs


def _choose(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    greedy = [info.params.is_greedy for info in infos]
    if all(greedy):
        return greedy_ids(logits)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    sampled = _sample_rows(logits[random_rows], [infos[i] for i in random_rows])
    if len(random_rows) == len(infos):
        return sampled
    next_ids = greedy_ids(logits)
    next_ids[random_rows] = sampled
    return next_ids


def chosen_logprobs(
    next_ids: torch.Tensor,
    raw_logprobs: torch.Tensor,
    infos: Sequence[SamplingInfo],
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Each row's logprob of its chosen id, and its top_logprobs_num best (logprob, id) pairs followed by those of its
    token_ids_logprob (waits for the device)."""
    chosen = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1).tolist()
    tops = best_logprobs(raw_logprobs, [info.top_logprobs_num for info in infos])
    return chosen, with_wanted(raw_logprobs, tops, [info.token_ids_logprob for info in infos])


def with_wanted(
    logprobs: torch.Tensor, tops: list[list[tuple[float, int]]], wanted: Sequence[Sequence[int]]
) -> list[list[tuple[float, int]]]:
    """Each row's top pairs followed by the (logprob, id) of every id in its `wanted` (token_ids_logprob)."""
    for i, ids in enumerate(wanted):
        if ids:
            tops[i] = tops[i] + list(zip(logprobs[i, list(ids)].tolist(), ids))
    return tops


def sample(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> SampleOutput:
    """Pick the next id for each row of logits [B, V] under that row's settings; logprobs when any row asks."""
    next_ids, raw_logprobs = sample_ids(logits, infos)
    logprobs = top_logprobs = None
    if raw_logprobs is not None:
        logprobs, top_logprobs = chosen_logprobs(next_ids, raw_logprobs, infos)
    return SampleOutput(next_ids=next_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)


def best_logprobs(logprobs: torch.Tensor, nums: Sequence[int]) -> list[list[tuple[float, int]]]:
    """Per row i, its nums[i] best (logprob, id) pairs from logprobs [B, V]."""
    kmax = min(max(nums, default=0), logprobs.shape[1])
    if kmax <= 0:
        return [[] for _ in nums]
    vals, ids = logprobs.topk(kmax, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [list(zip(vals[i][:n], ids[i][:n])) for i, n in enumerate(nums)]


def token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, top_k: int, wanted: Sequence[int] = ()
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Prompt logprobs: logprob of target_ids[i] under row i of logits [N, V], and each row's top_k (logprob, id)
    followed by those of the `wanted` ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids.to(logprobs.device, torch.long)[:, None]).squeeze(1).tolist()
    tops = best_logprobs(logprobs, [top_k] * logits.shape[0])
    return chosen, with_wanted(logprobs, tops, [wanted] * logits.shape[0])
