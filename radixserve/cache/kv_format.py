"""KV page formats: how the pool stores a token's K or V row for one KV head, and how a reader gets floats back.

A float format stores the row as is (`head_dim` elements of that dtype). `int8` stores the row quantized
symmetrically to -127..127 with one scale per GROUP (16) values, the scales after the values, one byte each: scales
per token, KV head and K/V. A scale byte c means 2^(c / 16 - 14) (`SCALES`: 16 steps an octave, 2^-14 .. 2^1.94, so
max |x| up to 486 before values clip; Qwen2.5's scales span 2^-13.6 .. 2^-0.5 over K and V), and the encoder takes the smallest scale not below max |x| / 127, so no value clips; rounding
the scale up costs at most 4.4% of the step (2.2% on average). A key row is first rotated by the orthonormal
Hadamard matrix H (`rotate_keys`): with one scale per row and no rotation, Qwen2.5's keys cost +5.7% perplexity over
4k tokens (the values barely matter); rotated, which spreads any large channel over the whole row, with a float16
scale per 16 the loss measured +0.12%, per 32 +0.76%, and with these one-byte scales per 16 (benchmarks/RESULTS.md,
issue 40). Why one byte: 64 values + 4 scale bytes = 68-byte rows for head_dim 64, 1.88x the tokens of bfloat16
in the same memory, where float16 scales took 72 (1.78x) and the RAG hit rate fell short of 1.8x bfloat16's; a
byte holds the scale's octave and 1/16 of it, while a float8 e4m3 scale's 3 mantissa bits round up by up to 12.5%
and measured +0.89%. Readers rotate the query instead of the
pages (q . k = (qH) . (kH), H orthogonal), and the values are not rotated. Why per token rather than per page: a
page fills one token at a time during decode, so a page-wide scale would have to be re-derived and the page
re-quantized whenever a larger value arrives (each time losing precision), and one outlier token would coarsen its
15 neighbours; a row's own scale is final when it is written. Why in the row: every consumer that moves pages as
bytes (partial-page copy, the host and disk tiers, tensor-parallel shards split by KV head) then carries the scales
with the values and needs no second buffer. The readers take the group from the row width (head_dim + 1 byte a
group), so GROUP is set here alone; `KVFormat.tag` names the encoding, so a tier written with another int8 layout
is never read as this one.

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
_SCALE_BYTES = 1  # one scale code per group of an int8 row
GROUP = 16  # values per int8 scale, or the whole row where head_dim is smaller (see scale_group)
SCALE_STEPS, SCALE_BIAS = 16, 14  # scale code c means 2^(c / SCALE_STEPS - SCALE_BIAS)
# The 256 scales in float32: the mantissa 2^(i / 16) rounded once from the C library's pow (Python's ** on floats),
# times an exact power of two; kernels/cpu/kv_rotate.h builds the same table the same way, so both give the same bits.
SCALES = torch.tensor(
    [2.0 ** (i / SCALE_STEPS) * 2.0 ** (c - SCALE_BIAS) for c in range(256 // SCALE_STEPS) for i in range(SCALE_STEPS)],
    dtype=torch.float32,
)
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

    @property
    def tag(self) -> str:
        """The format and, for int8, its row encoding: what a tier's layout records, so pages written with another
        encoding (float16 scales, another group) never feed this one."""
        return f"int8-g{GROUP}-log{SCALE_STEPS}b{SCALE_BIAS}" if self.scaled else self.name

    def row_width(self, head_dim: int) -> int:
        """Elements of one stored row: head_dim, plus the scales' bytes for int8."""
        return head_dim + (head_dim // scale_group(head_dim) * _SCALE_BYTES if self.scaled else 0)

    def check_head_dim(self, head_dim: int) -> None:
        """int8 needs head_dim a power of two >= 16: whole scale groups of a multiple of 16 (the CPU decode kernel
        scales 16-lane registers), and a Hadamard matrix of that size."""
        if self.scaled and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise ValueError(f"kv_cache_dtype int8 needs head_dim a power of two >= 16; got {head_dim}")

    def rotate_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Keys (or queries) `[..., head_dim]` into the space int8 key pages are stored in, in float32; the identity
        (x itself) for the other formats. H is symmetric, so the same product also rotates back."""
        if not self.scaled:
            return x
        return fwht(x.to(torch.float32))

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K and V one token takes in the pool, over all layers."""
        return 2 * num_layers * num_kv_heads * self.row_width(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `[..., head_dim]` (any float dtype; keys already through rotate_keys) -> stored rows
        `[..., row_width]`."""
        if self.name == "int8":
            return _encode_int8(x)
        if self.name == "fp8_e4m3":
            return x.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).view(torch.uint8)
        return x.to(self.storage)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows `[..., row_width]` -> values `[..., head_dim]` in `dtype` (for int8, value times scale is
        taken in float32, then rounded once to `dtype`; int8 keys come back in their rotated space)."""
        if self.name == "fp8_e4m3":
            return rows.view(_FP8).to(dtype)
        if self.name != "int8":
            return rows.to(dtype)
        scales = row_scales(rows)
        values = rows[..., : -scales.shape[-1]].to(torch.float32).unflatten(-1, (scales.shape[-1], -1))
        return (values * scales[..., None]).flatten(-2).to(dtype)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales `[..., groups]` whose codes follow the values of int8 rows `[..., row_width]`: a row of
    head_dim >= GROUP holds head_dim / GROUP groups of GROUP + 1 bytes, a shorter one a single group, so the count
    is the width over GROUP + 1, rounded up."""
    groups = -(-rows.shape[-1] // (GROUP + _SCALE_BYTES))
    return SCALES[rows[..., -groups:].view(torch.uint8).long()]


def scale_group(head_dim: int) -> int:
    """Values per scale in an int8 row of head_dim values: GROUP, or the whole row where head_dim is smaller."""
    return min(GROUP, head_dim)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x `[..., n]` (float32, n a power of two) times the n x n Walsh-Hadamard matrix / sqrt(n) (orthonormal and
    symmetric), as the fast transform: log2(n) stages of a + b, a - b on pairs h apart. The C++ store and decode ops
    (kernels/cpu/kv_rotate.h) run the same stages in the same order, so both give the same bits."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], -2).flatten(-3)
        h *= 2
    return x * torch.tensor(n**-0.5, dtype=torch.float32)


def _encode_int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric quantization per scale_group(head_dim) values: the scale is the smallest of SCALES not below
    max |x| / 127 (the largest where none is), and each value x / scale (float32 division) is rounded half to even
    and clamped to +-127 (the clamp only acts past the largest scale)."""
    xf = x.to(torch.float32).unflatten(-1, (-1, scale_group(x.shape[-1])))
    code = torch.searchsorted(SCALES, (xf.abs().amax(-1) / _INT8_MAX).contiguous()).clamp_(max=len(SCALES) - 1)
    q = (xf / SCALES[code][..., None]).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).flatten(-2)
    return torch.cat([q, code.to(torch.uint8).view(torch.int8)], -1)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """`auto` keeps the model's dtype for the KV pages (the measurements in benchmarks/RESULTS.md decide whether
    that changes); any other name is taken as is."""
    if kv_cache_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."))
    return KVFormat(kv_cache_dtype)
