"""Paged extend (prefill) attention: each request's new tokens attend to its cached prefix and to themselves.

One program handles a block of new tokens of one request for all the query heads of one GQA group: its
BLOCK_M rows are (token, head) pairs, so each K/V block it loads serves the whole group. It first streams the
request's prefix pages from the pool (every new token sees every prefix token, so no mask beyond the length),
then the new tokens' own K/V straight from the packed k/v inputs with the causal mask, all in one
online-softmax state. On a cache hit the prefix is long and the new part short: the prefix costs only page
reads, shared by the group's heads.

Batch-invariant (deterministic mode, radixserve/model/deterministic.py): every key, cached or new, is read from
the pages in blocks at fixed absolute positions, and each token is the row of its program that its position
names, so a row's sums depend on its position alone, not on where its chunk or the cached prefix ends, nor on the
other rows of its program; a decode token runs as a one-token extend.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve_kernels.common import attention_num_warps, dot_precision, extend_blocks, needs_upcast, next_pow2
from radixserve_kernels.kv_load import load_kv_rows, scale_group
from radixserve_kernels.online_softmax import attend_block


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    K_buf,
    V_buf,
    PageTable,
    QoIndptr,
    PrefixLens,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bkp,
    stride_bks,
    stride_bkh,
    stride_bvp,
    stride_bvs,
    stride_bvh,
    stride_pt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_SCALE_GROUP: tl.constexpr,
    V_SCALE_GROUP: tl.constexpr,
    BATCH_INVARIANT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(QoIndptr + b)
    ext_len = tl.load(QoIndptr + b + 1) - q_start
    prefix_len = tl.load(PrefixLens + b)
    start_m = tl.program_id(2) * BLOCK_TOK
    if BATCH_INVARIANT:
        # Tiles at fixed absolute positions: the token at position p is row p % BLOCK_TOK of its tile whatever the
        # chunk (a row's dot products may depend on its row in the tile: in the interpreter's matmul they do).
        start_m -= prefix_len % BLOCK_TOK
    if start_m >= ext_len:  # the grid covers the longest request; shorter ones have nothing here
        return

    # Row r is query token start_m + r // BLOCK_G of head kvh * GROUP + r % BLOCK_G (the group padded to BLOCK_G).
    offs_r = tl.arange(0, BLOCK_TOK * BLOCK_G)
    tok = start_m + offs_r // BLOCK_G
    head = kvh * GROUP + offs_r % BLOCK_G
    mask_r = (tok >= 0) & (tok < ext_len) & (offs_r % BLOCK_G < GROUP)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + (rows * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_TOK * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_TOK * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_TOK * BLOCK_G, BLOCK_D], dtype=tl.float32)

    # Batch-invariant: every key from the pool's pages (the new tokens' were stored before this runs), in blocks
    # at fixed absolute positions 0, BLOCK_N, ... up to each row's own position, whatever the prefix/new split.
    # A block past a row's position is all -inf for it and leaves its state bit for bit unchanged (alpha = 1,
    # p = 0), so its tile-mates' lengths do not reach it. Otherwise the prefix pages, visible to every new token.
    end_n = tl.minimum(ext_len, start_m + BLOCK_TOK)
    pool_len = prefix_len
    if BATCH_INVARIANT:
        pool_len += end_n
    for n0 in range(0, pool_len, BLOCK_N):
        n = n0 + offs_n
        mask_n = n < pool_len
        page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        k_row = page * stride_bkp + slot * stride_bks + kvh * stride_bkh
        v_row = page * stride_bvp + slot * stride_bvs + kvh * stride_bvh
        k = load_kv_rows(K_buf, k_row, offs_d, mask_n, mask_d, HEAD_DIM, K_SCALE_GROUP).to(q.dtype)
        v = load_kv_rows(V_buf, v_row, offs_d, mask_n, mask_d, HEAD_DIM, V_SCALE_GROUP).to(q.dtype)
        if BATCH_INVARIANT:
            visible = (n[None, :] <= prefix_len + tok[:, None]) & mask_n[None, :]
        else:
            visible = mask_n[None, :]
        m_i, l_i, acc = attend_block(q, k, v, visible, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

    if not BATCH_INVARIANT:
        # New tokens: causal, so this block of queries needs keys only up to its last token.
        for n0 in range(0, end_n, BLOCK_N):
            n = n0 + offs_n
            mask_n = n < end_n
            kv_rows = (q_start + n).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                K + kv_rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(q.dtype)
            v = tl.load(
                V + kv_rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(q.dtype)
            causal = (tok[:, None] >= n[None, :]) & mask_n[None, :]
            m_i, l_i, acc = attend_block(q, k, v, causal, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(
        Out + (rows * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Write into `out` `[T, H, D]` the causal attention of the packed new tokens q `[T, H, D]`.

    Request b owns rows qo_indptr[b]:qo_indptr[b+1] (k/v `[T, kv_heads, D]` are their keys and values) and sees
    first its prefix_lens[b] cached tokens through page_table `[B, max_pages]` into k_buf/v_buf
    `[num_pages, page_size, kv_heads, D]` (or int8 rows of D values and their scales: radixserve_kernels/kv_load.py).
    Index tensors are int32 on q's device; `max_extend_len` bounds the grid; `block_m` is the (token, head) rows per
    program. `batch_invariant`: read the new tokens' keys from the pages too (k/v must be stored there already and
    are not read), in blocks at fixed positions. Returns `out`.
    """
    _, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_buf.shape
    batch = prefix_lens.numel()
    group = heads // kv_heads
    assert all(t.stride(-1) == 1 for t in (q, k, v, out, k_buf, v_buf))
    default_m, default_n = extend_blocks(dim, q.dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "block_m must be a power of two >= 16 (tl.dot rows)"
    block_g = next_pow2(group, at_least=1)
    block_tok = max(1, block_m // block_g)  # rows = max(block_m, block_g) >= 16
    # Batch-invariant tiles start at a multiple of block_tok before the chunk: one more tile may be needed.
    grid = (batch, kv_heads, triton.cdiv(max_extend_len, block_tok) + batch_invariant)
    _extend_kernel[grid](
        q,
        k,
        v,
        out,
        k_buf,
        v_buf,
        page_table,
        qo_indptr,
        prefix_lens,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        k_buf.stride(2),
        v_buf.stride(0),
        v_buf.stride(1),
        v_buf.stride(2),
        page_table.stride(0),
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_G=block_g,
        BLOCK_TOK=block_tok,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(dim),
        UPCAST=needs_upcast(_extend_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        K_SCALE_GROUP=scale_group(k_buf, dim),  # int8: keys a scale per 16, values one a row
        V_SCALE_GROUP=scale_group(v_buf, dim),
        BATCH_INVARIANT=batch_invariant,
        num_warps=num_warps or attention_num_warps(dim, q.dtype),
    )
    return out
