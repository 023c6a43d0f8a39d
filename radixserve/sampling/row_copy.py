"""The sampler's own copy of a logits batch, which penalties and biases write (the caller's stays as it was).

Why not `clone()` on CPU: torch copies a vocabulary-wide row (~0.6 MB of float32) in a parallel region, and with
OpenMP PASSIVE (radixserve's setting) that wakes a sleeping thread and waits for it: a decode step's clone took
0.58 ms on the 2-core machine when it was busy (cProfile, 128 steps, load ~5) and ~0.02 ms when idle. numpy copies
on the calling thread (~9 us).
"""

from __future__ import annotations

import torch

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def private_copy(logits: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` with its own memory (same values, dtype, shape and device)."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and logits.is_contiguous():
        return torch.from_numpy(logits.detach().numpy().copy())
    return logits.clone()
