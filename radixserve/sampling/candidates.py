"""Sampling one CPU row among its top-k candidates: the same filters and draw as the sampler's full-vocabulary path,
on the few ids top-k keeps.

Why: the default model's publisher settings (temperature 0.7, top-k 20, top-p 0.8) sent every CPU decode step
through ~10 passes over 152k logits (divide, top-k, mask, softmax, a 512-wide top-k for top-p, softmax, cumsum,
search), 4.3-5.2 ms of a ~25 ms step at one stream (RESULTS.md, issue 38 session 28). Here two passes find the
candidates and the rest works on them.

The same tokens as the full path: top-k keeps exactly the ids whose tempered logit is at least the k-th best
(ties included), which are found among the raw logits at least the k-th raw one less a margin wide enough for any
value that divides to the same float; the tempered values come from the same division; the draw is the same
inverse CDF in vocabulary order (filtered ids add no mass). Sums over fewer terms may differ in their last bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from radixserve.sampling_params import SamplingParams

# A row with 0 < top_k <= this takes this path; a row with more candidates than MAX_CANDIDATES (a flat row, ties at
# the k-th logit) takes the full path.
TOP_K_CANDIDATES = 128
MAX_CANDIDATES = 4096
CANDIDATE_BLOCK = 64  # logits per block maximum


def nucleus_cut(
    sorted_logits: torch.Tensor, sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Given each row's best ids in order: ([R, 1] lowest logit top-p keeps, [R, 1] mass of all the ids given).

    An id is kept while the mass ranked above it is below top_p.
    """
    mass = sorted_probs.cumsum(dim=-1)
    cut = sorted_logits.masked_fill(mass - sorted_probs >= top_p, float("inf")).amin(dim=-1, keepdim=True)
    return cut, mass[:, -1:]


def takes_candidates(logits: torch.Tensor, params: SamplingParams) -> bool:
    """True for a row of CPU logits whose top-k is small enough for this path."""
    return logits.device.type == "cpu" and 0 < params.top_k <= TOP_K_CANDIDATES


def _margin(v: float) -> float:
    """v less a margin: fl(x / t) == fl(v / t) needs |x - v| within about an ulp of v, and 2^-20 of v is eight."""
    return v - (abs(v) * 2.0**-20 + 1e-30)


def _kth(a: np.ndarray, k: int) -> float:
    return float(np.partition(a, a.size - k)[a.size - k])


def top_candidates(row: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending ids of `row` [V] whose logit is at least the k-th best's margin (every id top-k can keep after any
    temperature), or None where the full path must do it (fewer than k finite logits, a NaN, a flat row).

    Through block maxima: the k-th best block maximum m is at most the k-th best logit, so every candidate lies in a
    block whose maximum passes m's margin, and the k-th best of those blocks' logits is the row's. Block j is the
    strided set j, j + n, j + 2n, ... (n = vocab // 64): numpy's maximum of 64 rows of n took 25 us a 152k row,
    its maximum within 2374 rows of 64 took 150.
    """
    vocab = row.shape[0]
    n = vocab // CANDIDATE_BLOCK
    if n < k:
        return None
    block_max = row[: n * CANDIDATE_BLOCK].reshape(CANDIDATE_BLOCK, n).max(axis=0)
    m = _kth(block_max, k)
    if not math.isfinite(m):  # fewer than k finite blocks (banned ids), or a NaN
        return None
    chosen = np.flatnonzero(block_max >= _margin(m))
    members = (np.arange(CANDIDATE_BLOCK)[:, None] * n + chosen).ravel()
    ids = np.concatenate([members, np.arange(n * CANDIDATE_BLOCK, vocab)])  # ascending: i n + j, j < n
    if ids.size > 4 * MAX_CANDIDATES:
        return None
    vals = row[ids]
    ids = ids[vals >= _margin(_kth(vals, k))]
    return ids if ids.size <= MAX_CANDIDATES else None


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x, dtype=np.float64).astype(np.float32)  # as torch's CPU cumsum of float32: a double sum


def sample_candidates(row: torch.Tensor, params: SamplingParams, u: float) -> int | None:
    """The id drawn for the CPU float32 `row` [V] with uniform `u`, or None where the full path must do it.

    In numpy: a small torch op took 10-25 us on the machine measured, numpy's 1-5."""
    k, logits = params.top_k, row.numpy()
    ids = top_candidates(logits, k)
    if ids is None:
        return None
    x = logits[ids] / np.float32(params.temperature)  # the full path's float32 division
    x[x < _kth(x, k)] = -np.inf
    if params.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = _softmax(x)[order]
        kept = _cumsum(probs) - probs < np.float32(params.top_p)
        if kept.any():
            x[x < x[order][kept].min()] = -np.inf
    if params.min_p > 0.0:
        x[x < x.max() + np.log(np.float32(params.min_p))] = -np.inf
    cdf = _cumsum(_softmax(x))
    pick = int(np.searchsorted(cdf, np.float32(u) * cdf[-1], side="right"))
    return int(ids[min(pick, ids.size - 1)])
