"""Loading KV rows from the pool's pages in the attention kernels, whatever the KV format.

Float pages hold head_dim values per row; int8 pages (radixserve/cache/kv_format.py) hold head_dim values followed by
a float16 scale per group of them (keys a scale per 16, values one a row: each buffer's group is its own). Both kernels read pages through this one helper, so they decode int8 exactly as the
torch reference does: value x scale in float32, then the caller's cast to the query dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scale_group(buf: torch.Tensor, head_dim: int) -> int:
    """Values per scale of the pool buffer's int8 rows, read off the row width (head_dim + 2 bytes a group); 0 for
    float rows."""
    if buf.dtype != torch.int8:
        return 0
    return head_dim * 2 // (buf.shape[-1] - head_dim)


@triton.jit
def load_kv_rows(Buf, row, offs_d, mask_n, mask_d, HEAD_DIM: tl.constexpr, SCALE_GROUP: tl.constexpr):
    """Rows `[N, BLOCK_D]` of a pool buffer whose rows start at element offsets `row` `[N]` (int64); masked rows and
    columns read 0. SCALE_GROUP > 0: int8 rows (`scale_group`), returned in float32 times their groups' scales."""
    mask = mask_n[:, None] & mask_d[None, :]
    x = tl.load(Buf + row[:, None] + offs_d[None, :], mask=mask, other=0)
    if SCALE_GROUP > 0:
        at = Buf + row[:, None] + HEAD_DIM + 2 * (offs_d[None, :] // SCALE_GROUP)  # the scale of each element's group
        scale = tl.load(at.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
        x = x.to(tl.float32) * scale.to(tl.float32)
    return x
