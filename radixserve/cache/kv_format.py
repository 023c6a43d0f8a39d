"""KV page formats: how the pool stores a token's K or V row for one KV head, and how a reader gets floats back.

A float format stores the row as is (`head_dim` elements of that dtype). `int8` stores the row quantized
symmetrically to -127..127, the float16 scales (2 int8 bytes each) after the values, and K and V rows have different
widths. Both rows are first rotated by an orthonormal Hadamard transform (keys by H, `rotate`; values by H S,
`rotate_values`, S a fixed sign pattern: VALUE_SIGNS), which spreads any large channel over the whole row. A key row
carries one scale per KEY_GROUP (16) values: with one scale per row and no rotation, Qwen2.5's keys cost +5.7%
perplexity over 4k tokens; rotated, with a scale per 16 the loss measured +0.09%, with a scale per 32 +0.76%
(benchmarks/RESULTS.md, issue 40), so the key group stays 16. A value row carries ONE scale for the whole row, and
the 4% more tokens than with values per 16 are what reach the RAG hit-rate goal; the rotation cuts such rows'
squared error by a third (over the default model's values), and perplexity against bfloat16 KV measured +0.13% at
4k tokens and +0.38% at 8k on one text, +0.84% at 8k on another (unrotated: +0.38%, +0.61%, +0.90%;
benchmarks/RESULTS.md, issue 40, session 12, which also shows how far rounding alone moves those figures). Readers rotate the query instead of the key pages
(q . k = (qH) . (kH), H orthogonal) and the attention output instead of the value pages (it is linear in the
values: sum p v = S H (sum p H S v), as H H = I and S S = I; S is applied first, then H).
Why per token rather than per page: a
page fills one token at a time during decode, so a page-wide scale would have to be re-derived and the page
re-quantized whenever a larger value arrives (each time losing precision), and one outlier token would coarsen its
15 neighbours; a row's own scale is final when it is written. Why in the row: every consumer that moves pages as
bytes (partial-page copy, the host and disk tiers, tensor-parallel shards split by KV head) then carries the scales
with the values and needs no second buffer. For head_dim 64 a key row is 64 + 4 x 2 = 72 bytes, a value row
64 + 2 = 66: 138 bytes a K/V pair against bfloat16's 256, so the same memory holds 1.86x the tokens (72/72 rows
held 1.78x). The readers take each buffer's group from its row width (head_dim + 2 bytes a group), so the groups
are set here alone.

`fp8_e4m3` stores `float8_e4m3fn` bits with no scale (a scale of 1, FlashInfer's default), values clamped to +-448,
the format's largest: the layout FlashInfer's fp8 KV kernels read on CUDA (they get the buffers viewed as
`float8_e4m3fn`). The pool holds them as uint8 because torch's CPU index_copy_ / index_select, which every page
move uses, do not take float8 tensors.
"""

from __future__ import annotations

import functools
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
_SCALE_BYTES = 2  # one float16 per group of an int8 row
KEY_GROUP = 16  # values per scale of an int8 key row, or the whole row where head_dim is smaller (see scale_group)
KINDS = ("k", "v")  # which rows: keys (a scale per KEY_GROUP) or values (one scale a row), both rotated
# Channels of a value row negated before its rotation (bit d % 64 set: channel d), so value rows are rotated by
# H S rather than H. Which way rows round moves perplexity by a few tenths of a percent on our texts: five value
# encodings of one error (H, and H S for four random S) measured -0.05% to +0.41% at 4k tokens and +0.38% to +0.68%
# at 8k (benchmarks/RESULTS.md, issue 40, session 12). This S (the second) measured +0.13% and +0.38%, H alone +0.35%
# and +0.68%: it was chosen on figures of the text it was measured on. Keys keep H alone: random signs there cost
# +1.5% at 4k. radixserve_kernels/cpu/kv_rotate.h holds the same constant (the store and decode tests compare the two).
VALUE_SIGNS = 0x9D5C26DD7FEBC391
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

    def row_width(self, head_dim: int, kind: str) -> int:
        """Elements of one stored key (`kind` "k") or value ("v") row: head_dim, plus the scales' bytes for int8."""
        return head_dim + (head_dim // scale_group(head_dim, kind) * _SCALE_BYTES if self.scaled else 0)

    def key_width(self, head_dim: int) -> int:
        return self.row_width(head_dim, "k")

    def value_width(self, head_dim: int) -> int:
        return self.row_width(head_dim, "v")

    def check_head_dim(self, head_dim: int) -> None:
        """int8 needs head_dim a power of two >= 16: whole scale groups of a multiple of 16 (the CPU decode kernel
        scales 16-lane registers), and a Hadamard matrix of that size."""
        if self.scaled and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise ValueError(f"kv_cache_dtype int8 needs head_dim a power of two >= 16; got {head_dim}")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or queries `[..., head_dim]` into the space int8 key pages are stored in, in float32; the identity
        (x itself) for the other formats. H is symmetric and H H = I, so the same product also rotates back."""
        if not self.scaled:
            return x
        return fwht(x.to(torch.float32))

    def rotate_values(self, x: torch.Tensor) -> torch.Tensor:
        """Values `[..., head_dim]` into the space int8 value pages are stored in (H S: the VALUE_SIGNS, then H), in
        float32; the identity for the other formats."""
        if not self.scaled:
            return x
        return fwht(flip_value_signs(x.to(torch.float32)))

    def unrotate_values(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of rotate_values (S H), for values read back or an attention output over int8 value pages (a
        sum of rotated values), in float32; the identity for the other formats."""
        if not self.scaled:
            return x
        return flip_value_signs(fwht(x.to(torch.float32)))

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V one token takes in the pool, over all layers."""
        width = self.key_width(head_dim) + self.value_width(head_dim)
        return num_layers * num_kv_heads * width * self.storage.itemsize

    def encode(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """Key (`kind` "k") or value ("v") rows `[..., head_dim]` (any float dtype; int8 rows already rotated,
        keys by `rotate`, values by `rotate_values`) -> stored rows `[..., row_width(head_dim, kind)]`."""
        if self.name == "int8":
            return _encode_int8(x, scale_group(x.shape[-1], kind))
        if self.name == "fp8_e4m3":
            return x.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).view(torch.uint8)
        return x.to(self.storage)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype, kind: str) -> torch.Tensor:
        """Stored key (`kind` "k") or value ("v") rows `[..., row_width]` -> `[..., head_dim]` in `dtype` (for int8,
        value times scale is taken in float32, then rounded once to `dtype`; int8 rows come back in their rotated
        space)."""
        if self.name == "fp8_e4m3":
            return rows.view(_FP8).to(dtype)
        if self.name != "int8":
            return rows.to(dtype)
        scales = row_scales(rows, kind)
        values = rows[..., : -scales.shape[-1] * _SCALE_BYTES].to(torch.float32).unflatten(-1, (scales.shape[-1], -1))
        return (values * scales[..., None]).flatten(-2).to(dtype)


def row_scales(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 scales `[..., groups]` after the values of int8 key (`kind` "k") or value ("v") rows
    `[..., row_width]`. A value row holds one. A key row of head_dim >= KEY_GROUP holds head_dim / KEY_GROUP groups
    of KEY_GROUP + 2 bytes, a shorter one a single group, so the count is the width over KEY_GROUP + 2, rounded up
    (the width alone cannot tell: a 66-byte row is 64 values and one scale, or 55 values and 11 groups of 5)."""
    groups = 1 if _kind(kind) == "v" else -(-rows.shape[-1] // (KEY_GROUP + _SCALE_BYTES))
    return rows[..., -groups * _SCALE_BYTES :].contiguous().view(_SCALE_DTYPE).to(torch.float32)


def scale_group(head_dim: int, kind: str) -> int:
    """Values per scale in an int8 key (`kind` "k") or value ("v") row of head_dim values: for keys KEY_GROUP, or
    the whole row where head_dim is smaller; for values the whole row."""
    return head_dim if _kind(kind) == "v" else min(KEY_GROUP, head_dim)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"a KV row is a key ('k') or a value ('v'); got {kind!r}")
    return kind


def flip_value_signs(x: torch.Tensor) -> torch.Tensor:
    """x `[..., n]` with channel d negated where bit d % 64 of VALUE_SIGNS is set (exact in any dtype)."""
    return torch.where(_value_flips(x.shape[-1]).to(x.device), -x, x)


@functools.cache
def _value_flips(n: int) -> torch.Tensor:
    return torch.tensor([bool(VALUE_SIGNS >> (d % 64) & 1) for d in range(n)])


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x `[..., n]` (float32, n a power of two) times the n x n Walsh-Hadamard matrix / sqrt(n) (orthonormal and
    symmetric), as the fast transform: log2(n) stages of a + b, a - b on pairs h apart. The C++ store and decode ops
    (radixserve_kernels/cpu/kv_rotate.h) run the same stages in the same order, so both give the same bits."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], -2).flatten(-3)
        h *= 2
    return x * torch.tensor(n**-0.5, dtype=torch.float32)


def _encode_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric quantization per `group` values: scale = max |x| / 127, rounded to float16 first, so the values are
    divided by exactly the scale a reader multiplies by (the clamp absorbs a scale that rounded down)."""
    xf = x.to(torch.float32).unflatten(-1, (-1, group))
    scale = (xf.abs().amax(-1, keepdim=True) / _INT8_MAX).clamp(max=torch.finfo(_SCALE_DTYPE).max).to(_SCALE_DTYPE)
    s = scale.to(torch.float32)
    # An all-zero group (or one whose scale underflows float16) stores zeros: the division would give 0/0.
    q = torch.where(s > 0, xf / s.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    q = q.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).flatten(-2)
    return torch.cat([q, scale.squeeze(-1).contiguous().view(torch.int8)], -1)


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the names here spell it ("bfloat16"), for formats and digests."""
    return str(dtype).removeprefix("torch.")


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """`auto` keeps the model's dtype for the KV pages (the measurements in benchmarks/RESULTS.md decide whether
    that changes); any other name is taken as is."""
    if kv_cache_dtype == "auto":
        return KVFormat(dtype_name(model_dtype))
    return KVFormat(kv_cache_dtype)
