"""Logit penalties over tokens already seen: OpenAI frequency/presence penalties and HF repetition penalty."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from radixserve.sampling.info import SamplingInfo
from radixserve.transfer import device_tensor


def _padded_ids(
    id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, L] ids, [R, L] bool (a real entry), [R, 1] bool (the row has one); every list must be non-empty.

    Padding and ids >= vocab (a tokenizer larger than the model's head: they cannot be sampled) are not real entries;
    they point at the row's smallest real id, so a scatter of per-id values writes that id's value again, never another.
    """
    width = max(len(ids) for ids in id_lists)
    rows = [[*ids, *([ids[0]] * (width - len(ids)))] for ids in id_lists]
    ids = device_tensor(rows, device, torch.long)
    lengths = device_tensor([len(x) for x in id_lists], device)[:, None]
    valid = torch.arange(width, device=device)[None, :] < lengths
    valid &= (ids >= 0) & (ids < vocab)
    first = torch.where(valid, ids, vocab).amin(dim=1, keepdim=True)
    any_valid = first < vocab
    return torch.where(valid, ids, first.clamp_(max=vocab - 1)), valid, any_valid


def apply_penalties(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Return logits [B, V] with penalties applied (a new tensor when any row has one; the input is never modified).

    repetition_penalty (HF): each token in prompt + output has its logit divided by p if positive, else multiplied.
    frequency/presence (OpenAI): logit -= count_in_output * frequency_penalty + (count_in_output > 0) * presence.
    Work is O(tokens seen), not O(vocab): gathers and scatters at the seen ids only.
    """
    if _penalised_rows(infos) == ([], []):
        return logits
    out = logits.clone()
    _penalise(out, infos)
    return out


@contextlib.contextmanager
def penalised(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> Iterator[torch.Tensor]:
    """logits [B, V] with the penalties of `apply_penalties` written into it for the duration of the block, and
    the values they replaced put back on exit, errors included, so the caller's tensor reads as untouched after.

    Why not a copy: a copy of the whole [B, vocab] every step, where the undo is a scatter of the few hundred seen
    ids (RESULTS.md, issue 38 session 28)."""
    undo = _penalise(logits, infos)
    try:
        yield logits
    finally:
        for restore in reversed(undo):
            restore()


def _penalised_rows(infos: Sequence[SamplingInfo]) -> tuple[list[int], list[int]]:
    """(rows with a repetition penalty and ids to apply it to, rows with frequency or presence penalties and output)"""
    rep_rows = [
        i
        for i, info in enumerate(infos)
        if info.params.repetition_penalty != 1.0 and (info.prompt_ids or info.output_ids)
    ]
    fp_rows = [
        i
        for i, info in enumerate(infos)
        if info.output_ids and (info.params.frequency_penalty != 0.0 or info.params.presence_penalty != 0.0)
    ]
    return rep_rows, fp_rows


def _penalise(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> list[Callable[[], None]]:
    """Write the penalties into logits in place; returns the steps that put the old values back, in order."""
    rep_rows, fp_rows = _penalised_rows(infos)
    vocab, device = logits.shape[1], logits.device
    undo: list[Callable[[], None]] = []
    seen_rows = []  # (row, its distinct seen ids, its penalty)
    for i in rep_rows:
        # Each token is penalised once however often it occurs: the row's distinct seen ids, from the request's
        # SeenIds, grown by a step's new tokens only.
        info = infos[i]
        seen = (
            info.seen.ids(info.output_ids, vocab, device, info.drafts)
            if info.seen is not None
            else _seen(info, vocab, device)
        )
        seen_rows.append((i, seen, info.params.repetition_penalty))
    for values, index, p in _gather_jobs(logits, seen_rows):
        undo.append(_repetition(values, index, p))
    if fp_rows:
        ids, valid, any_valid = _padded_ids([infos[i].output_ids for i in fp_rows], vocab, device)
        freq = device_tensor([infos[i].params.frequency_penalty for i in fp_rows], device)[:, None]
        pres = device_tensor([infos[i].params.presence_penalty for i in fp_rows], device)[:, None]
        rows, sub = _rows_of(logits, fp_rows)
        # presence: idempotent write (once per distinct id); frequency: one subtraction per occurrence
        seen = sub.gather(1, ids)
        if rows is not None:
            undo.append(functools.partial(logits.index_copy_, 0, rows, sub.clone()))
        else:  # padding repeats a real id of its row, so the old values scatter back to the same places
            undo.append(functools.partial(sub.scatter_, 1, ids, seen))
        sub.scatter_(1, ids, torch.where(any_valid, seen - pres, seen))
        sub.scatter_add_(1, ids, torch.where(valid, -freq, 0.0).expand_as(ids).contiguous())
        if rows is not None:
            logits[rows] = sub
    return undo


Flat = torch.Tensor | np.ndarray


def _repetition(values: Flat, index: Flat, p: float) -> Callable[[], None]:
    """HF's repetition penalty on values[index] (positive logits divided by p, the rest multiplied), in place; returns
    what puts the old values back. numpy's arrays take the same float32 operations as torch's tensors, so the same
    values (p rounded to float32 either way), for a fraction of torch's per-op cost on a few hundred ids."""
    if isinstance(values, np.ndarray):
        assert isinstance(index, np.ndarray)
        x = values[index]
        values[index] = np.where(x > 0, x / np.float32(p), x * np.float32(p))
        return functools.partial(values.__setitem__, index, x)
    assert isinstance(index, torch.Tensor)
    x = values.index_select(0, index)
    values.index_copy_(0, index, torch.where(x > 0, x / p, x * p))
    return functools.partial(values.index_copy_, 0, index, x)


def _gather_jobs(
    logits: torch.Tensor, seen_rows: list[tuple[int, torch.Tensor, float]]
) -> list[tuple[Flat, Flat, float]]:
    """(a 1-D view of logits, indices into it, penalty) covering every (row, seen ids, penalty): on contiguous logits
    one job per penalty value, its rows' ids offset into the flat view (a gather and a scatter per row took ~60 us a
    row, 0.5 ms a step at eight streams: RESULTS.md, issue 38 session 48); else one per row. On the CPU, float32
    logits are viewed as a numpy array: the whole penalty took 0.29 ms of a one-stream decode step with torch's
    gather, where and scatter, 0.21 ms so (0.38 and 0.28 ms at eight streams; the caches are cold after the LM head:
    RESULTS.md, issue 38 session 50)."""
    if not logits.is_contiguous():
        return [(logits.select(0, i), seen, p) for i, seen, p in seen_rows]
    by_penalty: dict[float, list[tuple[int, torch.Tensor]]] = {}
    for i, seen, p in seen_rows:
        by_penalty.setdefault(p, []).append((i, seen))
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        flat = logits.detach().numpy().reshape(-1)  # a view: writes land in logits
        return [
            (flat, np.concatenate([seen.numpy() + i * vocab for i, seen in rows]), p) for p, rows in by_penalty.items()
        ]
    flat = logits.view(-1)
    return [(flat, torch.cat([seen + i * vocab for i, seen in rows]), p) for p, rows in by_penalty.items()]


def _seen(info: SamplingInfo, vocab: int, device: torch.device) -> torch.Tensor:
    """The distinct ids of a row built without a SeenIds (the request path always gives it one)."""
    return device_tensor([t for t in {*info.prompt_ids, *info.output_ids} if 0 <= t < vocab], device, torch.long)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(index, a copy of those rows to write back through it), or (None, logits itself) when every row is one of
    them: at one stream that spares two copies of the vocabulary-wide row a step (the caller's clone is written)."""
    if len(rows) == logits.shape[0]:
        return None, logits
    index = device_tensor(rows, logits.device)
    return index, logits[index]
