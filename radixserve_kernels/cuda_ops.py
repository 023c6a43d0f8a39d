"""FlashInfer's fused elementwise ops for the CUDA path: the counterpart of radixserve_kernels/cpu's add_rms_norm and
rope.

Why: a small-batch decode step reads the weights once and is otherwise a train of tiny kernels. On the H100
(RESULTS.md, issue 25) a Llama-3-8B step launched 815 kernels, ~700 of them norms, RoPE, SiLU*mul and residual adds
of 2-3 us each. FlashInfer's norm, activation and rope modules do residual add + RMSNorm, SiLU-and-mul and RoPE
(in place, on the qkv projection's own columns) in one kernel each.

`for_tensor(x)` returns the ops where they apply (a CUDA tensor in float16/bfloat16, flashinfer importable,
RADIXSERVE_CUDA_FUSED not 0), else None, and every caller then runs its torch ops. Each method also returns None
for a shape FlashInfer's kernels do not take (rows not 16-byte aligned, a head size without a kernel), so the
fallback is per call. Roundings differ from the torch path: FlashInfer keeps the residual sum in float32 through
the norm and rounds once, so the two agree to the dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

FUSED_DTYPES = (torch.float16, torch.bfloat16)
ROPE_HEAD_DIMS = (64, 128, 256, 512)  # FlashInfer's DISPATCH_HEAD_DIM


def _aligned(width: int, dtype: torch.dtype) -> bool:
    """FlashInfer's elementwise kernels load 16 bytes at a time."""
    return width * dtype.itemsize % 16 == 0


class FusedOps:
    """The three fused ops over a flashinfer-like module (`norm`, `activation`, `rope`); tests pass a fake one."""

    def __init__(self, fi: Any) -> None:
        self.fi = fi

    def add_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + residual, its RMSNorm times weight) as RMSNorm.add_forward; with a residual, both inputs are
        overwritten (the sum lands in `residual`, the norm in `h`), so callers pass tensors they no longer need."""
        if h.dim() != 2 or h.stride(-1) != 1 or not _aligned(h.shape[-1], h.dtype) or weight.dtype != h.dtype:
            return None
        if residual is None:
            return h, self.fi.norm.rmsnorm(h, weight, eps)
        if residual.shape != h.shape or residual.stride(-1) != 1 or residual.dtype != h.dtype:
            return None
        self.fi.norm.fused_add_rmsnorm(h, residual, weight, eps)  # residual += h; h = rmsnorm(residual) * weight
        return residual, h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for `[T, 2 * I]` laid out gate first, as MLP.gate_up_proj writes it."""
        if gate_up.stride(-1) != 1 or not _aligned(gate_up.shape[-1] // 2, gate_up.dtype):
            return None
        return self.fi.activation.silu_and_mul(gate_up)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
        """Rotate q `[T, H, D]` and k `[T, KH, D]` in place (rotate-half convention) at `positions`; False where
        the kernel does not apply. `cos_sin_cache` is `[max_position, D]` float32, cos in the first half."""
        head_dim = q.shape[-1]
        if head_dim not in ROPE_HEAD_DIMS or q.stride(-1) != 1 or k.stride(-1) != 1:
            return False
        if q.stride(1) != head_dim or k.stride(1) != head_dim:  # heads must be adjacent to flatten into a row
            return False
        t = q.shape[0]
        self.fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(t, -1), k.view(t, -1), head_dim, cos_sin_cache, is_neox=True
        )
        return True


@functools.cache
def _ops() -> FusedOps | None:
    if os.environ.get("RADIXSERVE_CUDA_FUSED", "1") == "0":
        return None
    try:
        import flashinfer
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
    except Exception:  # noqa: BLE001 - no flashinfer (or a broken one): the torch ops run instead
        return None
    return FusedOps(flashinfer)


def for_tensor(x: torch.Tensor) -> FusedOps | None:
    """The fused ops for `x`'s device and dtype, or None (see the module docstring)."""
    if x.device.type != "cuda" or x.dtype not in FUSED_DTYPES:
        return None
    return _ops()
