"""KV store: copy each new token's K and V rows into its slot of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve_kernels.common import next_pow2


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Loc,
    stride_kt,
    stride_vt,
    stride_bk,
    stride_bv,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    slot = tl.load(Loc + t).to(tl.int64)
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    # A same-dtype store moves raw bits, so bf16 needs no interpreter upcast here.
    tl.store(K_buf + slot * stride_bk + offs, k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(V_buf + slot * stride_bv + offs, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 1024
) -> None:
    """Write k/v `[T, kv_heads, D]` into pool pages `[num_pages, page_size, kv_heads, D]` at flat slots `loc` `[T]`.

    Slot s is token s % page_size of page s // page_size; the pages' (kv_heads, D) rows must be contiguous.
    """
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    k, v = k.reshape(tokens, row), v.reshape(tokens, row)
    kb, vb = k_buf.view(-1, row), v_buf.view(-1, row)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    block = min(block, next_pow2(row))
    _store_kv_kernel[(tokens, triton.cdiv(row, block))](
        k,
        v,
        kb,
        vb,
        loc,
        k.stride(0),
        v.stride(0),
        kb.stride(0),
        vb.stride(0),
        ROW=row,
        BLOCK=block,
    )
