"""Host-to-device copies that never wait for the device.

A copy from pageable host memory to a GPU is followed by a stream synchronisation in PyTorch (`torch.tensor(x,
device="cuda")`, `.to("cuda")`, indexing a CUDA tensor with a Python list): the host then waits for every kernel
already queued, the step in flight included, and holds the GIL meanwhile. Going through pinned memory with
`non_blocking=True` queues the copy in stream order instead.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; CPU to CUDA through pinned memory without blocking."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def device_tensor(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` without the stream synchronisation on CUDA."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory when CUDA is in use (a host tensor that a library copies to the device itself)."""
    return t.pin_memory() if torch.cuda.is_initialized() else t
