"""One step of the online (streaming) softmax shared by the attention kernels, in the base-2 domain."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, k, v, mask, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold keys k `[N, D]` / values v `[N, D]` into the running state of queries q `[M, D]`.

    `mask` `[M, N]` is True where a query may see a key; every query row must see at least one key in the
    blocks folded so far, or its max stays -inf. `m_i` is the running max of the base-2 logits, `l_i` the
    running sum of exp2(logit - m_i), `acc` the unnormalized output; the updated triple is returned.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
