"""Weight-only int8 and int4 linears for CPU.

Why weight-only: a decode step reads every weight once, so fewer bytes per weight (int8: half of bf16, int4 about a
quarter) is what makes batch-1 decode faster.

- int8: symmetric, one scale per output channel, codes packed for our kernel (radixserve_kernels/cpu/int8_linear.cpp;
  see `pack_int8` and Int8Linear). Its 1-2-row path keeps activations in float32; from 3 rows on the AVX-512 VNNI path
  rounds them to int8 per block of 32 columns (as llama.cpp does), INT8_ACT_TOL below. In deterministic mode
  (radixserve/model/deterministic.py) every row count, 1 row and prefill included, takes the VNNI path.
- int4: asymmetric, one (scale, zero) per group of 32/64/128 input columns; `torch._weight_int4pack_mm_for_cpu(x,
  packed, group, scale_zeros [K/group, N, 2])` with packed = `torch._convert_weight_to_int4pack_for_cpu(q, 1)`.
  The op's formula (tinygemm's) is w = (q - 8) * scale + zero with q in 0..15, so a symmetric format (GGUF Q4_0)
  maps exactly with zero = 0 and an affine one (Q4_K: w = d*q - m) with zero = 8*d - m. It runs with bf16
  activations (fp16 for fp16 models): with float32 ones it was 10-60x slower (benchmarks/quant_linear.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import radixserve_kernels.cpu as cpu_kernels

# Per-format tolerance the tests hold a quantized matmul to: relative Frobenius error ||y - x W^T|| / ||x W^T|| on
# random normal weights and inputs. Rounding to a step `d` adds an error of rms d/sqrt(12) per weight, so:
# int8 (d = 2 max|w|/254 per row, ~0.026 sigma): measured 0.007; int4 (d = (max - min)/15 per group, ~0.27-0.35
# sigma for groups of 32-128): measured 0.08 / 0.09 / 0.10. The bounds leave room for small shapes' spread and
# for the bf16 rounding of activations, scales and output (~0.4%).
INT8_REL_TOL = 0.015
# The int8 kernel against its own dequantized weight (the activations' rounding alone): float32 activations (1-2
# rows, AVX2, dense) only round in bf16 models (~0.3%); the VNNI path's int8 activations add d/sqrt(12) per value
# with d = absmax/127 of its block of 32, ~0.5% of the output on normal inputs (measured 0.5-0.8%).
INT8_ACT_TOL = 0.01
INT4_REL_TOL = {32: 0.13, 64: 0.14, 128: 0.15}
# Below this many rows Int8Linear runs our int8 kernel, whose cost grows with rows; from it on, it widens the codes
# and runs the dense matmul. Measured on the default model's shapes (AVX-512 VNNI, bf16, RESULTS.md issue 14 fourth
# pass): the kernel 2-3x faster at 8-16 rows, a tie at 32-64, the dense matmul 1.2-1.5x faster at 96-192.
INT8_KERNEL_ROWS = 48
_PACK_ROWS, _PACK_COLS = 8, 64  # radixserve_kernels/cpu/int8_linear.cpp's block: 8 output rows x 64 input columns
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


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes `[N, K]` -> the layout radixserve_kernels/cpu/int8_linear.cpp streams: uint8 (q + 128)
    `[N/8, K/64, 8, 64]`, N and K padded to multiples of 8 and 64 with code 128 (weight 0)."""
    n, k = q.shape
    padded = torch.full((n + -n % _PACK_ROWS, k + -k % _PACK_COLS), 128, dtype=torch.uint8)
    padded[:n, :k] = (q.to(torch.int16) + 128).to(torch.uint8)
    rows, cols = padded.shape
    return padded.view(rows // _PACK_ROWS, _PACK_ROWS, cols // _PACK_COLS, _PACK_COLS).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The padded codes `[N_pad, K_pad]` as `dtype` (exact: int8 values fit bf16 and float32), unscaled."""
    ops = cpu_kernels.ops()
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        return ops.int8_unpack(packed, dtype)
    blocks, chunks = packed.shape[:2]
    plain = packed.transpose(1, 2).reshape(blocks * _PACK_ROWS, chunks * _PACK_COLS)
    return (plain.to(torch.int16) - 128).to(dtype)


class Int8Linear(nn.Module):
    """y = x (q * s)^T + b with int8 `q` `[N, K]` and per-row `s`; returns the activations' dtype.

    Holds only the packed codes (`pack_int8`) and float32 scales: steps of fewer than INT8_KERNEL_ROWS rows run our
    kernel (radixserve_kernels/cpu/int8_linear.cpp), which reads the int8 bytes once per step; larger steps (prefill)
    widen the codes to the activations' dtype for that call and run the dense matmul, the scale applied after. Same
    weights either way (DESIGN.md: one model, one set of weights).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = q.shape
        padded_scale = torch.ones(n + -n % _PACK_ROWS, dtype=torch.float32)
        padded_scale[:n] = scale
        self._init(pack_int8(q), padded_scale, k, n, bias)

    def _init(
        self, codes: torch.Tensor, scale: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self._scales: dict[torch.dtype, torch.Tensor] = {}
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # --deterministic (radixserve/model/deterministic.py): every row count runs the kernel's one batch-invariant
        # path, so a row's output does not depend on the other rows of the step.
        self.batch_invariant = False

    @classmethod
    def from_packed(
        cls, codes: torch.Tensor, scale: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None
    ) -> Int8Linear:
        """The layer from its saved `codes` and `scale` buffers (radixserve/model/prepared.py): no repacking."""
        self = cls.__new__(cls)
        self._init(codes, scale, in_features, out_features, bias)
        return self

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        q, scale = quantize_int8(weight)
        return cls(q, scale, bias)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q `[N, K]` int8, scale `[N]`) without the padding."""
        q = unpack_int8(self.codes, torch.int16)[: self.out_features, : self.in_features].to(torch.int8)
        return q, self.scale[: self.out_features]

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        s = self._scales.get(dtype)
        if s is None:
            s = self._scales[dtype] = self.scale.to(dtype)
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        k_pad = self.codes.shape[1] * _PACK_COLS
        ops = cpu_kernels.ops()
        small = x2.shape[0] < INT8_KERNEL_ROWS or self.batch_invariant
        if ops is not None and small and x.dtype in (torch.float32, torch.bfloat16):
            y = ops.int8_linear(x2, self.codes, self.scale, self.bias, self.out_features, self.batch_invariant)
            return y.reshape(*shape[:-1], self.out_features)
        if k_pad != self.in_features:
            x2 = F.pad(x2, (0, k_pad - self.in_features))
        if ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            # Dense in the model's own dtype (bf16: oneDNN, AMX where present; float32 on CPUs without bf16
            # hardware), the codes widened a cache-sized slice at a time; the per-row scale factors out.
            y = ops.int8_linear_dense(x2, self.codes, self.scale, self.out_features)
        else:
            y = (F.linear(x2, unpack_int8(self.codes, x.dtype)) * self._scale(x.dtype))[:, : self.out_features]
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
