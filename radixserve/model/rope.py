"""Rotary position embedding (rotate-half / NeoX convention) with a cos/sin cache indexed by absolute position."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import radixserve_kernels.cpu as cpu_kernels
import radixserve_kernels.cuda_ops as cuda_ops

_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the fused CPU op takes


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (float32) and the cos/sin scale for a Hugging Face `rope_scaling` dict.

    Supports default, linear, dynamic (NTK; equal to default inside the context window, which is all we cache),
    llama3 and yarn. The formulas follow the published definitions so that float32 results match transformers bit for bit.
    """
    # Same expression as transformers, so the float32 rounding is identical.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    assert scaling is not None
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, factor, max_position)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, dynamic, llama3, yarn)")


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], factor: float, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, blend over a ramp of dimensions; scale cos/sin by mscale."""
    orig_len = scaling.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(orig_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """Holds cos|sin `[max_position, head_dim]` (float32, cos in the first half: FlashInfer's layout, so the CUDA
    path reads it as is); `forward(positions)` gives the step's `RopeStep`."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", torch.empty(max_position, head_dim), persistent=False)
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        """(Re)compute the cache in float32 on the buffer's device (needed after meta init). A `model.to(dtype)`
        before this would have cast the buffer: it is made float32 again, as FlashInfer's kernel requires."""
        if self.cos_sin_cache.is_meta:
            return
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = torch.empty_like(self.cos_sin_cache, dtype=torch.float32)
        inv_freq, attn_factor = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        half = self.head_dim // 2
        self.cos_sin_cache[:, :half].copy_(freqs.cos() * attn_factor)
        self.cos_sin_cache[:, half:].copy_(freqs.sin() * attn_factor)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, fused: cuda_ops.FusedOps | None) -> RopeStep:
        """The rotation for absolute `positions` `[T]`: with `fused` (the CUDA path) no lookup happens here, the
        kernel reads the cache; else cos, sin `[T, 1, head_dim // 2]` in `dtype`, broadcastable over heads."""
        if fused is not None and self.cos_sin_cache.dtype == torch.float32:
            return RopeStep(positions, None, None, self.cos_sin_cache, fused)
        cos, sin = lookup(self.cos_sin_cache, positions, dtype)
        return RopeStep(positions, cos, sin, self.cos_sin_cache, None)


@dataclass(frozen=True)
class RopeStep:
    """One step's rotation: what the torch path needs (cos, sin) or what the fused kernel needs (positions, cache)."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    cos_sin_cache: torch.Tensor
    fused: cuda_ops.FusedOps | None

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, H, D]` and k `[T, KH, D]` rotated. The fused CUDA kernel rotates them in place; on CPU one op
        (radixserve_kernels/cpu/norm_rope.cpp rope_qk) rotates both; the torch path rotates them as one tensor when k's
        heads follow q's in memory (the qkv projection's output), which halves its ops per layer."""
        if self.fused is not None and self.fused.rope_qk(q, k, self.positions, self.cos_sin_cache):
            return q, k
        if self.cos is None or self.sin is None:  # a shape the kernel refused: look up as the torch path does
            cos, sin = lookup(self.cos_sin_cache, self.positions, q.dtype)
        else:
            cos, sin = self.cos, self.sin
        ops = cpu_kernels.ops() if q.device.type == "cpu" and q.dtype in _FUSED_DTYPES else None
        if ops is not None and _heads_dense(q) and _heads_dense(k) and k.dtype == q.dtype:
            return ops.rope_qk(q, k, cos, sin)  # one op, no joined view to check and split (~5 us a layer)
        if _adjacent(q, k):
            qk = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
            return apply_rope(qk, cos, sin).split([q.shape[1], k.shape[1]], dim=1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def lookup(cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin `[T, 1, head_dim // 2]` in `dtype`, each contiguous (the CPU rope op would copy a strided one per
    layer)."""
    rows = cos_sin_cache.index_select(0, positions).to(dtype)
    return tuple(half.contiguous().unsqueeze(1) for half in rows.chunk(2, dim=-1))


def _heads_dense(x: torch.Tensor) -> bool:
    """The CPU rope ops' layout: each row's heads and their values dense (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when k `[T, KH, D]` continues q `[T, H, D]` in every row of one buffer (same strides, k's first head
    right after q's last). With one token the row stride is moot (views of a `[1, N]` row give each part its own),
    and a decode step at one stream is that case."""
    return (
        (q.stride(0) == k.stride(0) or q.shape[0] == 1)
        and q.stride()[1:] == k.stride()[1:]
        and q.stride(1) == q.shape[2]
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + q.shape[1] * q.shape[2]
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]`: the first half pairs with the second half (rotate-half convention).

    On CPU one fused op (radixserve_kernels/cpu/norm_rope.cpp) with the same roundings replaces the seven below."""
    ops = cpu_kernels.ops() if x.device.type == "cpu" and x.dtype in _FUSED_DTYPES else None
    if ops is not None and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return ops.rope(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
