"""KV page formats: how the pool stores a token's K or V row for one KV head, and how a reader gets floats back.

A float format stores the row as is (`head_dim` elements of that dtype). `int8` stores the row quantized
symmetrically to -127..127 and appends its scale (float16, as 2 int8 bytes) at the end of the row: one scale per
token, KV head and K/V. Why per token rather than per page: a page fills one token at a time during decode, so a
page-wide scale would have to be re-derived and the page re-quantized whenever a larger value arrives (each time
losing precision), and one outlier token would coarsen its 15 neighbours; a row's own scale is final when it is
written. Why in the row: every consumer that moves pages as bytes (partial-page copy, the host and disk tiers,
tensor-parallel shards split by KV head) then carries the scales with the values and needs no second buffer. The cost
is 2 bytes in 66 per head_dim-64 row: the same memory holds 1.94x the tokens of bfloat16.

`fp8_e4m3` stores `float8_e4m3fn` bits with no scale (a scale of 1, FlashInfer's default), values clamped to +-448,
the format's largest: the layout FlashInfer's fp8 KV kernels read on CUDA (they get the buffers viewed as
`float8_e4m3fn`). The pool holds them as uint8 because torch's CPU index_copy_ / index_select, which every page
move uses, do not take float8 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.uint8,  # float8_e4m3fn bits (see the module docstring)
}
_FP8 = torch.float8_e4m3fn
_SCALE_DTYPE = torch.float16
_SCALE_BYTES = 2  # one float16 at the end of each int8 row
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: torch's cast does not saturate, so clamp first


@dataclass(frozen=True)
class KVFormat:
    """One KV page format; `name` is one of KV_DTYPES other than auto."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in _STORAGE:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}; got {self.name!r}")

    @property
    def storage(self) -> torch.dtype:
        """The element type of the pool's buffers."""
        return _STORAGE[self.name]

    @property
    def element(self) -> torch.dtype:
        """What the stored elements are: `storage`, except float8_e4m3fn for fp8 (held as uint8 bits)."""
        return _FP8 if self.name == "fp8_e4m3" else self.storage

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "fp8_e4m3")

    @property
    def scaled(self) -> bool:
        """Rows end with their own scale (int8)."""
        return self.name == "int8"

    def row_width(self, head_dim: int) -> int:
        """Elements of one stored row: head_dim, plus the scale's bytes for int8."""
        return head_dim + (_SCALE_BYTES if self.scaled else 0)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V one token takes in the pool, over all layers."""
        return 2 * num_layers * num_kv_heads * self.row_width(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `[..., head_dim]` (any float dtype) -> stored rows `[..., row_width]`."""
        if self.name == "int8":
            return _encode_int8(x)
        if self.name == "fp8_e4m3":
            return x.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).view(torch.uint8)
        return x.to(self.storage)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows `[..., row_width]` -> values `[..., head_dim]` in `dtype` (for int8, value times scale is
        taken in float32, then rounded once to `dtype`)."""
        if self.name == "fp8_e4m3":
            return rows.view(_FP8).to(dtype)
        if self.name != "int8":
            return rows.to(dtype)
        values = rows[..., :-_SCALE_BYTES].to(torch.float32)
        return (values * row_scales(rows)).to(dtype)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales `[..., 1]` at the end of int8 rows `[..., head_dim + 2]`."""
    return rows[..., -_SCALE_BYTES:].contiguous().view(_SCALE_DTYPE).to(torch.float32)


def _encode_int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row quantization: scale = max |x| / 127, rounded to float16 first, so the values are divided by
    exactly the scale a reader multiplies by (the clamp absorbs a scale that rounded down)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(-1, keepdim=True) / _INT8_MAX).clamp(max=torch.finfo(_SCALE_DTYPE).max).to(_SCALE_DTYPE)
    s = scale.to(torch.float32)
    # An all-zero row (or one whose scale underflows float16) stores zeros: the division would give 0/0.
    q = torch.where(s > 0, xf / s.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    q = q.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """`auto` keeps the model's dtype for the KV pages (the measurements in benchmarks/RESULTS.md decide whether
    that changes); any other name is taken as is."""
    if kv_cache_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."))
    return KVFormat(kv_cache_dtype)
