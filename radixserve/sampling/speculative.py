"""Verifying drafted tokens: from the logits of one extend step over [last token, d1..dk], the tokens the request
produces (the drafts it accepts, then one token of the model's own), distributed exactly as plain decoding.

Row i of the logits scores the token after d1..di. Greedy: accept d(i+1) while it is row i's argmax; the first row
whose argmax differs gives the correction. Sampled: speculative rejection sampling with a point-mass draft (an
n-gram draft has no distribution of its own): accept d with probability p_i(d), else sample from p_i with d removed
and renormalised; after k acceptances sample row k. Every emitted token thus has the plain sampler's distribution
given the tokens before it. Penalties see the accepted drafts as already generated (each row gets its own history).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from radixserve.sampling.info import SamplingInfo
from radixserve.sampling.penalties import apply_penalties
from radixserve.sampling.sampler import best_logprobs, filter_logits, greedy_ids


@dataclass
class DraftRun:
    """What one verified request produced: accepted drafts then the model's own token (len = accepted + 1)."""

    ids: list[int]
    logprobs: list[float] | None  # raw log_softmax of each id, when the request asked for logprobs
    top_logprobs: list[list[tuple[float, int]]] | None

    @property
    def accepted(self) -> int:
        return len(self.ids) - 1


def _has_penalties(info: SamplingInfo) -> bool:
    p = info.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def row_infos(info: SamplingInfo, draft: Sequence[int]) -> list[SamplingInfo]:
    """One SamplingInfo per verify row: row i's penalties count draft[:i] as generated (it scores the token after)."""
    if not _has_penalties(info):
        return [info] * (len(draft) + 1)
    # Rows past the first share the request's SeenIds, which keeps none of their drafts (SamplingInfo.drafts).
    return [info] + [
        replace(info, output_ids=[*info.output_ids, *draft[:i]], drafts=i) for i in range(1, len(draft) + 1)
    ]


def _accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    targets = greedy_ids(logits).tolist()
    j = 0
    while j < len(draft) and draft[j] == targets[j]:
        j += 1
    return targets[: j + 1]


def _accept_sampled(logits: torch.Tensor, infos: list[SamplingInfo], draft: Sequence[int]) -> list[int]:
    """Rejection sampling against a point-mass draft; draws from torch's global RNG (seeded requests never draft)."""
    probs = filter_logits(logits, infos).softmax(dim=-1)
    k = len(draft)
    u = torch.rand(k).tolist()
    rows = torch.arange(k, device=probs.device)
    p_draft = probs[rows, torch.tensor(list(draft), dtype=torch.long, device=probs.device)].tolist() if k else []
    ids: list[int] = []
    for i, d in enumerate(draft):
        if u[i] < p_draft[i]:
            ids.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # max(p - q, 0) with q the point mass at d, renormalised by multinomial
        ids.append(int(torch.multinomial(residual, 1)))
        return ids
    ids.append(int(torch.multinomial(probs[k], 1)))
    return ids


def verify(logits: torch.Tensor, info: SamplingInfo, draft: Sequence[int]) -> DraftRun:
    """The tokens one request produces from its verify rows `logits` [len(draft) + 1, V]."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{logits.shape[0]} verify rows for a draft of {len(draft)} tokens")
    logits = logits.float()
    infos = row_infos(info, draft)
    scored = apply_penalties(logits, infos)
    if info.params.is_greedy:
        ids = _accept_greedy(scored, draft)
    else:
        ids = _accept_sampled(scored, infos, draft)
    run = DraftRun(ids, None, None)
    if info.return_logprob or info.top_logprobs_num:
        raw = torch.log_softmax(logits[: len(ids)], dim=-1)
        run.logprobs = raw.gather(1, torch.tensor(ids, device=raw.device)[:, None]).squeeze(1).tolist()
        run.top_logprobs = best_logprobs(raw, [info.top_logprobs_num] * len(ids))
    return run
