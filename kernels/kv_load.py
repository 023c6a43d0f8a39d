"""Loading KV rows from the pool's pages in the attention kernels, whatever the KV format.

Float pages hold head_dim values per row; int8 pages (radixserve/cache/kv_format.py) hold head_dim values followed by
a float16 scale per 16 of them. Both kernels read pages through this one helper, so they decode int8 exactly as the torch
reference does: value x scale in float32, then the caller's cast to the query dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_rows(Buf, row, offs_d, mask_n, mask_d, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr):
    """Rows `[N, BLOCK_D]` of a pool buffer whose rows start at element offsets `row` `[N]` (int64); masked rows and
    columns read 0. SCALED: int8 rows, returned in float32 times their groups' scales."""
    mask = mask_n[:, None] & mask_d[None, :]
    x = tl.load(Buf + row[:, None] + offs_d[None, :], mask=mask, other=0)
    if SCALED:
        at = Buf + row[:, None] + HEAD_DIM + 2 * (offs_d[None, :] // 16)  # the scale of each element's group
        scale = tl.load(at.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
        x = x.to(tl.float32) * scale.to(tl.float32)
    return x
