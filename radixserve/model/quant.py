"""Weight-only int8 linears for CPU: per-output-channel symmetric int8 weights, matmul by `torch._weight_int8pack_mm`.

Why int8 weight-only: a decode step reads every weight once, so halving the bytes (vs bf16) or quartering them
(vs float32) is what makes batch-1 decode faster; activations stay in the model's dtype. torch's packed op takes
the int8 weight `[N, K]` and one scale per output row, and dequantizes inside the kernel (no float copy of W).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Per-format tolerance the tests hold a quantized matmul to, relative to the float32 result's scale: symmetric
# int8 rounding is at most half a step (max|w|/254 per row), so errors stay well under 1% of |y|'s spread.
INT8_REL_TOL = 0.02


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight `[N, K]`, float32 scale `[N]`) with weight ~= q * scale[:, None]; an all-zero row gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Int8Linear(nn.Module):
    """y = x (q * s)^T + b with int8 `q` `[N, K]` and per-row `s`; returns the activations' dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self._scales: dict[torch.dtype, torch.Tensor] = {}  # the op wants scales in the activations' dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        q, scale = quantize_int8(weight)
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op runs in bf16 even for float32 models: with float32 activations it was 12-60x slower here
        # (AVX-512-BF16, benchmarks/quant_linear.py) and 9x slower on AVX2 (issue 14); bf16 rounding of x is
        # far below the int8 weight error.
        act = torch.float16 if x.dtype == torch.float16 else torch.bfloat16
        s = self._scales.get(act)
        if s is None:
            s = self._scales[act] = self.scale.to(act)
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(act).contiguous(), self.qweight, s)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def plain_weight(linear: nn.Module) -> torch.Tensor:
    """The dense `[N, K]` weight of one of our Linears (a oneDNN-blocked copy cannot be read back)."""
    if linear.weight.is_mkldnn:
        raise ValueError("quantize before pack_for_cpu: a oneDNN-packed weight cannot be read back")
    return linear.weight


@torch.no_grad()
def quantize_model_int8(model: nn.Module) -> int:
    """Replace every Linear of a LlamaForCausalLM (LM head included, tied or not) by an Int8Linear; returns how many.

    A tied head gets its own int8 copy (the embedding lookup keeps the plain rows); vocab x hidden bytes in int8.
    """
    from radixserve.model.llama import Linear

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear.from_float(plain_weight(child), child.bias))
                count += 1
    if getattr(model, "lm_head", None) is None and getattr(model, "tied_head", None) is None:
        model.tied_head = Int8Linear.from_float(model.embed_tokens.weight, None)
        count += 1
    return count


def reference_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 result of the same dequantized weight: what the packed op must reproduce up to rounding."""
    return F.linear(x.float(), dequantize_int8(q, scale), None if bias is None else bias.float())
