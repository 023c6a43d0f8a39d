"""Paged decode attention: one query token per request over all its KV pages, split-KV in two stages.

Stage 1 gives each (request, KV head, split) one program, which attends the query heads of the whole GQA group
to one contiguous range of the request's tokens and writes a partial output plus its log-sum-exp. Stage 2
merges the splits of each (request, head). Splitting the keys keeps the GPU busy when the batch is small and
the sequences are long; with a single split, stage 1 writes the final output and stage 2 is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve_kernels.common import attention_num_warps, decode_block_n, dot_precision, needs_upcast, next_pow2
from radixserve_kernels.kv_load import load_kv_rows, scale_group
from radixserve_kernels.online_softmax import attend_block


@triton.jit
def _decode_split_kernel(
    Q,
    K_buf,
    V_buf,
    PageTable,
    SeqLens,
    Out,
    PartialOut,
    PartialLse,
    sm_scale_log2,
    num_splits,
    stride_qb,
    stride_qh,
    stride_outb,
    stride_outh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_SCALE_GROUP: tl.constexpr,
    V_SCALE_GROUP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    # Splits start on BLOCK_N boundaries so only the last block of a split is partial; trailing splits may be empty.
    # (Plain integer ceil-divisions: tl.cdiv is a nested jit call, which the interpreter makes costly.)
    split_len = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP  # the group (e.g. 7 heads) is padded to BLOCK_H rows for tl.dot
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        mask_n = n < end
        page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        k_row = page * stride_kp + slot * stride_ks + kvh * stride_kh
        v_row = page * stride_vp + slot * stride_vs + kvh * stride_vh
        k = load_kv_rows(K_buf, k_row, offs_d, mask_n, mask_d, HEAD_DIM, K_SCALE_GROUP).to(q.dtype)
        v = load_kv_rows(V_buf, v_row, offs_d, mask_n, mask_d, HEAD_DIM, V_SCALE_GROUP).to(q.dtype)
        m_i, l_i, acc = attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

    if SINGLE_SPLIT:
        tl.store(
            Out + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
            (acc / l_i[:, None]).to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
        return
    # An empty split leaves l_i == 0: it writes a zero output with lse -inf, which the merge weighs by 0.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(
        PartialOut + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
        out,
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(PartialLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    PartialOut,
    PartialLse,
    Out,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(PartialLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    part = tl.load(
        PartialOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds a key, so the max is finite
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_workspace(
    batch_size: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for the partial outputs `[B, H, S, D]` and log-sum-exps `[B, H, S]` of stage 1."""
    return (
        torch.empty(batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device),
    )


def decode_num_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    max_splits: int = 16,
    min_tokens_per_split: int = 128,
) -> int:
    """Splits per request: enough programs for about two waves over `num_sms`, none shorter than the minimum."""
    want = math.ceil(2 * num_sms / max(1, batch_size * num_kv_heads))
    return max(1, min(max_splits, want, math.ceil(max_seq_len / min_tokens_per_split)))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Write into `out` `[B, H, D]` the attention of q `[B, H, D]` over the first seq_lens[b] tokens of request b.

    k_buf/v_buf are one layer's pool pages `[num_pages, page_size, kv_heads, row]` (row = head_dim, or int8 rows of
    the values, then a float16 scale per group: radixserve_kernels/kv_load.py; int8 keys are stored rotated, so
    q must come rotated too: radixserve/cache/kv_format.py); page_table `[B, max_pages]`
    and seq_lens `[B]` are int32 on q's device. Every seq_len must be >= 1. `workspace` (from `decode_workspace`)
    is needed only for num_splits > 1 and allocated here if not given. Returns `out`.
    """
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_buf.shape
    group = heads // kv_heads
    single = num_splits == 1
    if single:
        part, lse = out, out  # not touched: stage 1 writes `out` directly
    else:
        part, lse = workspace if workspace is not None else decode_workspace(batch, heads, dim, num_splits, q.device)
        assert part.shape == (batch, heads, num_splits, dim) and lse.shape == (batch, heads, num_splits)
        assert part.stride(-1) == 1 and lse.stride(-1) == 1
    assert q.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1 and out.stride(-1) == 1
    block_d = next_pow2(dim)
    block_n = block_n or decode_block_n(dim, q.dtype, k_buf.dtype == torch.int8)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_buf,
        v_buf,
        page_table,
        seq_lens,
        out,
        part,
        lse,
        scale * math.log2(math.e),
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        k_buf.stride(2),
        v_buf.stride(0),
        v_buf.stride(1),
        v_buf.stride(2),
        page_table.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_H=next_pow2(group),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=single,
        UPCAST=needs_upcast(_decode_split_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        K_SCALE_GROUP=scale_group(k_buf, dim),  # int8: keys a scale per 16, values one a row
        V_SCALE_GROUP=scale_group(v_buf, dim),
        num_warps=num_warps or attention_num_warps(dim, q.dtype),
    )
    if single:
        return out
    _decode_merge_kernel[(batch, heads)](
        part,
        lse,
        out,
        num_splits,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=dim,
        BLOCK_S=next_pow2(num_splits, at_least=2),
        BLOCK_D=block_d,
    )
    return out
