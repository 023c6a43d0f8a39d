"""Weight-only int8 and int4 linears for CPU, on torch's packed CPU ops.

Why weight-only: a decode step reads every weight once, so fewer bytes per weight (int8: half of bf16, int4 about a
quarter) is what makes batch-1 decode faster; activations stay in the model's dtype.

- int8: symmetric, one scale per output channel; `torch._weight_int8pack_mm(x, q [N, K], scale [N])`.
- int4: asymmetric, one (scale, zero) per group of 32/64/128 input columns; `torch._weight_int4pack_mm_for_cpu(x,
  packed, group, scale_zeros [K/group, N, 2])` with packed = `torch._convert_weight_to_int4pack_for_cpu(q, 1)`.
  The op's formula (tinygemm's) is w = (q - 8) * scale + zero with q in 0..15, so a symmetric format (GGUF Q4_0)
  maps exactly with zero = 0 and an affine one (Q4_K: w = d*q - m) with zero = 8*d - m.

Both ops run with bf16 activations (fp16 for fp16 models): with float32 activations they were 10-60x slower here
(benchmarks/quant_linear.py), and bf16 rounding of x is far below the weights' quantization error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Per-format tolerance the tests hold a quantized matmul to: relative Frobenius error ||y - x W^T|| / ||x W^T|| on
# random normal weights and inputs. Rounding to a step `d` adds an error of rms d/sqrt(12) per weight, so:
# int8 (d = 2 max|w|/254 per row, ~0.026 sigma): measured 0.007; int4 (d = (max - min)/15 per group, ~0.27-0.35
# sigma for groups of 32-128): measured 0.08 / 0.09 / 0.10. The bounds leave room for small shapes' spread and
# for the bf16 rounding of activations, scales and output (~0.4%).
INT8_REL_TOL = 0.015
INT4_REL_TOL = {32: 0.13, 64: 0.14, 128: 0.15}
# From this many rows on, Int8Linear widens its codes to bf16 and runs a dense matmul (oneDNN, AMX where present)
# instead of torch._weight_int8pack_mm, whose cost grows ~linearly with rows: on the AMX machine of RESULTS.md the
# op won at <= 8 rows and lost 2-7x at 32-512 rows, while the one-pass int8 -> bf16 widening is cheap next to a
# prefill chunk's matmul. Decode (1 row per stream) keeps reading int8 bytes only.
INT8_DENSE_ROWS = 16
INT4_GROUP_SIZES = (32, 64, 128)
_QUANT_ROWS = 8192
INT4_DEFAULT_GROUP = 64
_INT4_N_MULTIPLE = 16  # the packing op wants N divisible by 16: pad with zero rows, slice the output


def _op_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float16 if x.dtype == torch.float16 else torch.bfloat16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight `[N, K]`, float32 scale `[N]`) with weight ~= q * scale[:, None]; an all-zero row gets scale 1.

    In slices of rows, so the float temporaries of a 152k-row LM head stay small (they set the load's peak RSS)."""
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, _QUANT_ROWS):
        w = weight[lo : lo + _QUANT_ROWS].detach().float()
        s = w.abs().amax(dim=1) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        q[lo : lo + _QUANT_ROWS] = torch.clamp(torch.round(w / s[:, None]), -127, 127)
        scale[lo : lo + _QUANT_ROWS] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q `[N, K]` int32 in 0..15, scale `[N, K/group]`, zero `[N, K/group]`) with w ~= (q - 8) * scale + zero.

    Asymmetric min/max per group: the 16 levels span [min, max] of the group; a constant group gets scale 1.
    """
    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group size {group} does not divide in_features {k}")
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round((g - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    group = k // scale.shape[1]
    g = (q.reshape(n, -1, group).float() - 8) * scale[..., None] + zero[..., None]
    return g.reshape(n, k)


class Int8Linear(nn.Module):
    """y = x (q * s)^T + b with int8 `q` `[N, K]` and per-row `s`; returns the activations' dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self._scales: dict[torch.dtype, torch.Tensor] = {}  # the op wants scales in the activations' dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("dense", None)  # see keep_dense_copy

    def keep_dense_copy(self) -> None:
        """Keep the codes also as a oneDNN-packed bf16 matrix, used for steps of 2 rows or more (batched decode,
        prefill): the same weights (int8 values are exact in bf16, the per-row scale is applied after, as on the
        widening path), at bf16's speed there, while 1-row steps keep reading int8. Costs 2 more bytes per weight."""
        self.dense = torch.ops.mkldnn._reorder_linear_weight(self.qweight.to(torch.bfloat16))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        q, scale = quantize_int8(weight)
        return cls(q, scale, bias)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        s = self._scales.get(dtype)
        if s is None:
            s = self._scales[dtype] = self.scale.to(dtype)
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.dense is not None and x2.shape[0] >= 2 and x.dtype == torch.bfloat16:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.dense, None, "none", [], "") * self._scale(x.dtype)
        elif x2.shape[0] >= INT8_DENSE_ROWS:
            # Dense in the model's own dtype (float32 on CPUs without bf16 hardware); the per-row scale factors out.
            y = F.linear(x2, self.qweight.to(x.dtype)) * self._scale(x.dtype)
        else:
            act = _op_dtype(x)
            y = torch._weight_int8pack_mm(x2.to(act).contiguous(), self.qweight, self._scale(act))
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Int4Linear(nn.Module):
    """y = x W^T + b with W in int4 groups along K (see the module docstring); returns the activations' dtype.

    Holds only the packed nibbles (`[N_pad, K/2]` uint8) and float32 (scale, zero) pairs; N is padded to a
    multiple of 16 with zero rows for the packing op and the output sliced back.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        n, k = q.shape
        self.in_features, self.out_features, self.group = k, n, k // scale.shape[1]
        pad = -n % _INT4_N_MULTIPLE
        if pad:
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
            scale = torch.cat([scale, torch.ones(pad, scale.shape[1])])
            zero = torch.cat([zero, torch.zeros(pad, zero.shape[1])])
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        )
        # [K/group, N_pad, 2]: the layout the op reads
        self.register_buffer("scale_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().float())
        self._scale_zeros: dict[torch.dtype, torch.Tensor] = {}
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale_zeros: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> Int4Linear:
        """The layer from its saved `packed` and `scale_zeros` buffers (radixserve/model/prepared.py): no repacking."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.group = in_features, out_features, in_features // scale_zeros.shape[0]
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self._scale_zeros = {}
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_DEFAULT_GROUP) -> Int4Linear:
        return cls(*quantize_int4(weight, group), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = _op_dtype(x)
        sz = self._scale_zeros.get(act)
        if sz is None:
            sz = self._scale_zeros[act] = self.scale_zeros.to(act)
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(act).contiguous(), self.packed, self.group, sz
        )
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def int4_group_for(in_features: int, group: int) -> int | None:
    """`group` if it divides `in_features`, else the largest smaller supported group that does; None if none does."""
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= group and in_features % g == 0:
            return g
    return None


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group: int) -> nn.Module:
    """The Int8Linear or Int4Linear for one weight; a layer whose width no int4 group divides stays int8."""
    if fmt == "int4":
        g = int4_group_for(weight.shape[1], group)
        if g is not None:
            return Int4Linear.from_float(weight, bias, g)
    elif fmt != "int8":
        raise ValueError(f"unknown weight format {fmt!r}")
    return Int8Linear.from_float(weight, bias)


def plain_weight(linear: nn.Module) -> torch.Tensor:
    """The dense `[N, K]` weight of one of our Linears (a oneDNN-blocked copy cannot be read back)."""
    if linear.weight.is_mkldnn:
        raise ValueError("quantize before pack_for_cpu: a oneDNN-packed weight cannot be read back")
    return linear.weight


def _from_mapped(parts: list[Any], fmt: str, bias: torch.Tensor | None) -> nn.Module | None:
    """The linear built from GGUF-mapped codes of every stacked part (radixserve/gguf/blocks.py), or None when a
    part is missing or of another format (then the float weight is quantized instead)."""
    want = "Int4Mapping" if fmt == "int4" else "Int8Mapping"
    if not parts or any(p is None or type(p).__name__ != want for p in parts):
        return None
    if fmt == "int4":
        if len({p.scale.shape[1] for p in parts}) != 1:  # one group size across the stacked parts
            return None
        return Int4Linear(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            bias,
        )
    return Int8Linear(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), bias)


@torch.no_grad()
def quantize_model(
    model: nn.Module, fmt: str, group: int = INT4_DEFAULT_GROUP, mapped: dict[str, Any] | None = None
) -> tuple[int, int]:
    """Replace every Linear of a LlamaForCausalLM (LM head included, tied or not) by its `fmt` ("int8" or "int4")
    version; returns (how many, how many of those took their codes from `mapped`: Hugging Face tensor name ->
    GGUF block mapping). A tied head gets its own quantized copy (the embedding lookup keeps the plain rows)."""
    from radixserve.model.llama import Linear

    mapped = mapped or {}
    hf_parts = model.hf_parts()
    count = from_gguf = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            parts = [mapped.get(hf) for hf in hf_parts.get(f"{full}.weight", [])]
            lin = _from_mapped(parts, fmt, child.bias)
            from_gguf += lin is not None
            setattr(parent, name, lin or quantized_linear(plain_weight(child), child.bias, fmt, group))
            count += 1
    if getattr(model, "lm_head", None) is None and getattr(model, "tied_head", None) is None:
        lin = _from_mapped([mapped.get("model.embed_tokens.weight")], fmt, None)
        from_gguf += lin is not None
        model.tied_head = lin or quantized_linear(model.embed_tokens.weight, None, fmt, group)
        count += 1
    return count, from_gguf
