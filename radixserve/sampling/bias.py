"""Per-request additive logit rules: `logit_bias` (a fixed bias per token id) and `min_new_tokens` (the stop ids,
EOS included, are banned until that many tokens are out), as SGLang's logit-bias and min-new-tokens penalizers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.sampling.info import SamplingInfo
from radixserve.transfer import device_tensor


def apply_bias(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Logits [B, V] with each row's bias added and its banned ids at -inf (a new tensor when any row has either;
    the input is never modified). Ids past the model's head (a larger tokenizer) cannot be sampled and are skipped."""
    vocab = logits.shape[1]
    entries: list[tuple[int, int, float]] = []  # (row, id, bias)
    for row, info in enumerate(infos):
        for key, bias in (info.params.logit_bias or {}).items():
            entries.append((row, int(key), bias))
        entries.extend((row, t, float("-inf")) for t in info.banned_ids)
    entries = [e for e in entries if e[1] < vocab]
    if not entries:
        return logits
    rows, ids, biases = zip(*entries)
    device = logits.device
    logits = logits.clone()
    # index_put_ with accumulate adds every entry, so an id both biased and banned ends at -inf
    logits.index_put_(
        (device_tensor(list(rows), device, torch.long), device_tensor(list(ids), device, torch.long)),
        device_tensor(list(biases), device, logits.dtype),
        accumulate=True,
    )
    return logits
