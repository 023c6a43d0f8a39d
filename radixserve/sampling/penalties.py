"""Logit penalties over tokens already seen: OpenAI frequency/presence penalties and HF repetition penalty."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.sampling.sampler import SamplingInfo


def _scatter_rows(rows: Sequence[int], id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), vocab] table with 1 added at (r, id) for every id of id_lists[r] (so repeated ids count up)."""
    lengths = [len(ids) for ids in id_lists]
    table = torch.zeros((len(rows), vocab), dtype=dtype, device=device)
    if sum(lengths) == 0:
        return table
    flat = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                     torch.tensor(lengths, device=device))
    table.index_put_((row_of, flat), torch.ones((), dtype=dtype, device=device).expand(flat.numel()), accumulate=True)
    return table


def apply_penalties(logits: torch.Tensor, infos: Sequence["SamplingInfo"]) -> torch.Tensor:
    """Return logits [B, V] with penalties applied (a new tensor when any row has one; the input is never modified).

    repetition_penalty (HF): every token in prompt + output has its logit divided by p when positive, multiplied when not.
    frequency/presence (OpenAI): logit -= count_in_output * frequency_penalty + (count_in_output > 0) * presence_penalty.
    """
    rep_rows = [i for i, info in enumerate(infos) if info.params.repetition_penalty != 1.0]
    fp_rows = [i for i, info in enumerate(infos)
               if info.params.frequency_penalty != 0.0 or info.params.presence_penalty != 0.0]
    if not rep_rows and not fp_rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device

    if rep_rows:
        seen = _scatter_rows(rep_rows, [[*infos[i].prompt_ids, *infos[i].output_ids] for i in rep_rows],
                             vocab, device, torch.float32) > 0
        p = torch.tensor([infos[i].params.repetition_penalty for i in rep_rows], device=device)[:, None]
        idx = torch.tensor(rep_rows, device=device)
        rows = logits[idx]
        logits[idx] = torch.where(seen, torch.where(rows > 0, rows / p, rows * p), rows)

    if fp_rows:
        counts = _scatter_rows(fp_rows, [infos[i].output_ids for i in fp_rows], vocab, device, torch.float32)
        freq = torch.tensor([infos[i].params.frequency_penalty for i in fp_rows], device=device)[:, None]
        pres = torch.tensor([infos[i].params.presence_penalty for i in fp_rows], device=device)[:, None]
        idx = torch.tensor(fp_rows, device=device)
        logits[idx] = logits[idx] - counts * freq - (counts > 0).float() * pres
    return logits
