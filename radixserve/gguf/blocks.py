"""Map GGUF quantized blocks onto radixserve's weight-only formats without dequantizing the whole tensor to float32
first (radixserve/model/quant.py): the integer codes are reused and only the per-block scales are rearranged.

- Q4_0 (32 weights: fp16 d, codes q in 0..15, w = d * (q - 8)) -> int4 group 32 with scale = d, zero = 0: exact.
- Q4_K (256-weight super-blocks of 8 sub-blocks of 32: fp16 d, dmin, 6-bit sc/m per sub-block, codes q in 0..15,
  w = d*sc*q - dmin*m) -> int4 group 32 with scale = d*sc, zero = 8*scale - dmin*m: exact in float32 (the matmul
  op then rounds scale/zero to the activations' dtype, as for any int4 weight).
- Q8_0 (32 weights: fp16 d, int8 codes, w = d * q) -> int8 per output channel. Exact only when every block of a row
  has the same d, which llama.cpp's quantizer almost never produces (d = max|block|/127 per block), so the codes
  are requantized to one scale per row: q' = round(d_b * q / s_row) with s_row = max_b(d_b * max|q_b|) / 127. The
  error is at most half a per-row step on top of Q8_0's own; `Int8Mapping.exact` says which case it was.

All functions take the tensor's raw block bytes (`TableTensor.data`) and its PyTorch shape `[N, K]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from radixserve.gguf.reader import PERMUTED_ARCHITECTURES, hf_tensor_name, unpermute_rows
from radixserve.gguf.tensor_table import read_tensor_table

QK = 32  # weights per Q4_0 / Q8_0 block and per Q4_K sub-block
QK_K = 256  # weights per K-quant super-block
_ROWS_PER_SLICE = 4096


@dataclass(frozen=True)
class Int4Mapping:
    """Codes `[N, K]` int32 in 0..15 and float32 scale/zero `[N, K/32]`: w = (q - 8) * scale + zero."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True)
class Int8Mapping:
    """Codes `[N, K]` int8 and float32 per-row scale `[N]`: w ~= q * scale; `exact` if no code had to change."""

    q: torch.Tensor
    scale: torch.Tensor
    exact: bool


def _blocks(data: np.ndarray, n_rows: int, type_size: int) -> np.ndarray:
    """Raw bytes as `[N, blocks per row, type_size]` uint8."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    return raw.reshape(n_rows, -1, type_size)


def _fp16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 16-byte packing of 32 codes: low nibbles are codes 0..15, high nibbles codes 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_0_to_int4(data: np.ndarray, shape: tuple[int, int]) -> Int4Mapping:
    n, k = shape
    b = _blocks(data, n, 2 + QK // 2)  # [N, K/32, 18]
    d = _fp16(b[..., :2])  # [N, K/32]
    q = _nibbles(b[..., 2:]).reshape(n, k).astype(np.int32)
    scale = torch.from_numpy(d)
    return Int4Mapping(torch.from_numpy(q), scale, torch.zeros_like(scale))


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs packed in a super-block's 12 bytes, as llama.cpp's get_scale_min_k4."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def q4_k_to_int4(data: np.ndarray, shape: tuple[int, int]) -> Int4Mapping:
    n, k = shape
    b = _blocks(data, n, 4 + 12 + QK_K // 2)  # [N, K/256, 144]
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # [N, K/256]
    sc, mn = _q4_k_scale_min(b[..., 4:16])  # [N, K/256, 8]
    # 128 bytes of codes = 4 chunks of 32 bytes; chunk j holds sub-block 2j in its low and 2j+1 in its high nibbles.
    qs = b[..., 16:].reshape(n, -1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k).astype(np.int32)
    scale = (d[..., None] * sc).reshape(n, -1)
    zero = 8 * scale - (dmin[..., None] * mn).reshape(n, -1)
    return Int4Mapping(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero))


def q8_0_to_int8(data: np.ndarray, shape: tuple[int, int]) -> Int8Mapping:
    n, k = shape
    b = _blocks(data, n, 2 + QK)  # [N, K/32, 34]
    d = _fp16(b[..., :2])  # [N, K/32]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)  # [N, K/32, 32]
    if np.all(d == d[:, :1]):  # one scale per row already: reuse the codes as they are
        scale = np.where(d[:, 0] == 0, 1.0, d[:, 0]).astype(np.float32)
        return Int8Mapping(torch.from_numpy(q.reshape(n, k).copy()), torch.from_numpy(scale), True)
    row_max = (d * np.abs(q.astype(np.int16)).max(axis=-1)).max(axis=-1)  # max |w| per row
    scale = np.where(row_max == 0, 1.0, row_max / 127.0).astype(np.float32)
    factor = (d / scale[:, None]).astype(np.float32)[..., None]  # [N, K/32, 1]
    requant = np.empty((n, k), dtype=np.int8)
    # In slices of rows: the float temporaries stay a few MB even for a 152k-row LM head.
    for lo in range(0, n, _ROWS_PER_SLICE):
        hi = min(n, lo + _ROWS_PER_SLICE)
        requant[lo:hi] = np.clip(np.rint(q[lo:hi].astype(np.float32) * factor[lo:hi]), -127, 127).reshape(hi - lo, k)
    return Int8Mapping(torch.from_numpy(requant), torch.from_numpy(scale), False)


def _unpermuted(m: Int4Mapping | Int8Mapping, heads: int) -> Int4Mapping | Int8Mapping:
    """Undo llama.cpp's Q/K row order on every per-row array of a mapping (rows are independent in both formats)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_rows(t.numpy(), heads)))

    if isinstance(m, Int4Mapping):
        return Int4Mapping(rows(m.q), rows(m.scale), rows(m.zero))
    return Int8Mapping(rows(m.q), rows(m.scale), m.exact)


MAPPERS = {
    "int4": {GGMLQuantizationType.Q4_0: q4_0_to_int4, GGMLQuantizationType.Q4_K: q4_k_to_int4},
    "int8": {GGMLQuantizationType.Q8_0: q8_0_to_int8},
}


def mapped_tensors(
    gguf_path: str | Path, fmt: str, num_heads: int, num_kv_heads: int
) -> dict[str, Int4Mapping | Int8Mapping]:
    """Hugging Face weight name -> mapping, for every 2-D tensor of the GGUF whose block type maps onto `fmt`
    ("int4" or "int8"); tensors of other types are not in the result (the loader quantizes those from floats)."""
    table = read_tensor_table(gguf_path)
    permuted = table.architecture in PERMUTED_ARCHITECTURES
    out: dict[str, Int4Mapping | Int8Mapping] = {}
    for t in table.tensors.values():
        mapper = MAPPERS[fmt].get(t.type)
        if mapper is None or len(t.shape) != 2:
            continue
        m = mapper(t.data, t.shape)
        if permuted and ".attn_q." in t.name:
            m = _unpermuted(m, num_heads)
        elif permuted and ".attn_k." in t.name:
            m = _unpermuted(m, num_kv_heads)
        out[hf_tensor_name(t.name)] = m
    return out
