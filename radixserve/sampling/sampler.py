"""Batched sampler: penalties, greedy/temperature/top-k/top-p/min-p, per-request seeded RNG, and logprobs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.sampling.penalties import apply_penalties
from radixserve.sampling_params import SamplingParams


@dataclass
class SamplingInfo:
    """One row of a batch: its settings, RNG, and the tokens the penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None  # per request, seeded from params.seed; None draws from torch's global RNG
    output_ids: Sequence[int]  # generated so far (frequency/presence and repetition penalties)
    prompt_ids: Sequence[int]  # repetition penalty also covers the prompt (HF semantics)
    top_logprobs_num: int = 0
    return_logprob: bool = False


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float] | None  # raw log_softmax of each chosen token, for every row when any row asked
    top_logprobs: list[list[tuple[float, int]]] | None  # per row its top_logprobs_num (logprob, id), best first


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on device seeded with seed (a fresh random seed when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _exponential_noise(shape: tuple[int, int], infos: Sequence[SamplingInfo], device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, V]; a row with a generator draws its own V values, so its tokens do not depend on the batch."""
    noise = torch.empty(shape, device=device)
    unseeded = [j for j, info in enumerate(infos) if info.generator is None]
    if len(unseeded) == len(infos):
        return noise.exponential_()
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), shape[1]), device=device).exponential_()
    for j, info in enumerate(infos):
        gen = info.generator
        if gen is None:
            continue
        if gen.device == noise.device:
            noise[j].exponential_(generator=gen)
        else:  # a CPU generator for device logits: correct but slower, make generators on the logits' device
            noise[j] = torch.empty(shape[1], device=gen.device).exponential_(generator=gen).to(device)
    return noise


def _sample_rows(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Sample one id per row of logits [R, V] (all rows non-greedy): temperature, top-k, top-p, min-p, then draw."""
    rows, vocab = logits.shape
    device = logits.device
    params = [info.params for info in infos]
    temps = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temps[:, None]

    # Filters keep every token tied with the boundary value, so the fast top-k path and the sort path agree exactly
    # and a row's result does not depend on which path the rest of the batch needs.
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    need_k = any(ks)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if need_k:
            kth = sorted_logits.gather(1, (torch.tensor(ks, device=device).clamp_min(1) - 1)[:, None])
            kth[torch.tensor([k == 0 for k in ks], device=device)] = float("-inf")
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # keep a token while the mass ranked above it is below top_p; rows with top_p == 1 filter nothing
        drop = (mass_before >= top_p) & (top_p < 1.0)
        # a token tied in value with a kept token stays kept
        cut = sorted_logits.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    elif need_k:
        kmax = max(ks)
        top_vals = logits.topk(kmax, dim=-1).values
        kth = top_vals.gather(1, (torch.tensor(ks, device=device).clamp_min(1) - 1)[:, None])
        kth[torch.tensor([k == 0 for k in ks], device=device)] = float("-inf")
        logits = logits.masked_fill(logits < kth, float("-inf"))

    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)

    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (no renormalising needed).
    noise = _exponential_noise((rows, vocab), infos, device).clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> SampleOutput:
    """Pick the next id for each row of logits [B, V] under that row's settings; logprobs when any row asks."""
    if logits.shape[0] != len(infos):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(infos)} sampling infos were given")
    logits = logits.float()
    want_logprobs = any(info.return_logprob or info.top_logprobs_num > 0 for info in infos)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    logits = apply_penalties(logits, infos)
    greedy = [info.params.is_greedy for info in infos]
    if all(greedy):
        next_ids = logits.argmax(dim=-1)
    else:
        random_rows = [i for i, g in enumerate(greedy) if not g]
        sampled = _sample_rows(logits[random_rows], [infos[i] for i in random_rows])
        if len(random_rows) == len(infos):
            next_ids = sampled
        else:
            next_ids = logits.argmax(dim=-1)
            next_ids[random_rows] = sampled

    logprobs = top_logprobs = None
    if raw_logprobs is not None:
        logprobs = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1).tolist()
        top_logprobs = _top_logprobs(raw_logprobs, [info.top_logprobs_num for info in infos])
    return SampleOutput(next_ids=next_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)


def _top_logprobs(logprobs: torch.Tensor, nums: Sequence[int]) -> list[list[tuple[float, int]]]:
    """Per row i, its nums[i] best (logprob, id) pairs from logprobs [B, V]."""
    kmax = min(max(nums, default=0), logprobs.shape[1])
    if kmax <= 0:
        return [[] for _ in nums]
    vals, ids = logprobs.topk(kmax, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [list(zip(vals[i][:n], ids[i][:n])) for i, n in enumerate(nums)]


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                   top_k: int) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Prompt logprobs: logprob of target_ids[i] under row i of logits [N, V], and each row's top_k (logprob, id)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids.to(logprobs.device, torch.long)[:, None]).squeeze(1).tolist()
    return chosen, _top_logprobs(logprobs, [top_k] * logits.shape[0])
