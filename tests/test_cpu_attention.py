"""The fused CPU decode attention op (radixserve_kernels/cpu/decode_attention.cpp) against a float64 softmax reference
on random paged pools: this CPU's paths (AVX-512, and with AVX512_BF16 the bfloat16 one: head_dim 64, 128) and the
plain one (48), both thread splits, the checks on its inputs, and the other builds in a process of their own.
TorchAttentionBackend's use of it is covered by tests/test_torch_backend.py (op and SDPA paths alike)."""

from __future__ import annotations

import pytest
import torch

import radixserve_kernels.cpu
from other_builds import failure_on_build

OPS = radixserve_kernels.cpu.ops()
pytestmark = pytest.mark.skipif(
    OPS is None, reason="CPU kernels unavailable (no compiler, or RADIXSERVE_CPU_KERNELS=0)"
)

# The op computes in float32 and rounds its output once: float32 outputs are exact up to summation order and the
# exp polynomial (relative error < 2e-7); bfloat16 outputs are within half a bfloat16 ulp (2^-9 relative) of it.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
# With bfloat16 queries the softmax's weights may be rounded to bfloat16 before the values' pass (the AVX512_BF16
# path over bfloat16 pages does): each weight moves by at most 2^-8 of itself (its own rounding, and the sum's), so
# the output by at most 2^-8 of the weighted sum of |values| (`mass` below).
WEIGHT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2**-8}
ATOL = 1e-5
KV_HEADS = 2


def make_case(lens: list[int], page_size: int, ratio: int, dim: int, pool_dtype: torch.dtype, seed: int = 0):
    """Random K/V pages (page 0 unused, the rest shuffled among requests), a page table padded with 0, q."""
    gen = torch.Generator().manual_seed(seed)
    per = [(n + page_size - 1) // page_size for n in lens]
    num_pages = 1 + sum(per) + 2

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(pool_dtype)  # * 2: peakier softmaxes than unit scores

    k = randn(num_pages, page_size, KV_HEADS, dim)
    v = randn(num_pages, page_size, KV_HEADS, dim)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max(per + [1]), dtype=torch.int32)
    for r, n in enumerate(per):
        table[r, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(lens), KV_HEADS * ratio, dim, generator=gen)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, table, lens, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(q . k * scale) . v per request, keys gathered page by page, GQA by repeating kv heads; and
    the same weights times |v| (the mass whose share a weight's rounding can move)."""
    num_reqs, heads, dim = q.shape
    ratio = heads // k.shape[2]
    out = torch.zeros(num_reqs, heads, dim, dtype=torch.float64)
    mass = torch.zeros_like(out)
    for r in range(num_reqs):
        n = int(lens[r])
        pages = table[r, : (n + k.shape[1] - 1) // k.shape[1]].long()
        keys = k[pages].reshape(-1, k.shape[2], dim)[:n].double().repeat_interleave(ratio, 1)
        values = v[pages].reshape(-1, k.shape[2], dim)[:n].double().repeat_interleave(ratio, 1)
        scores = (q[r].double()[None] * keys).sum(-1) * scale  # [n, H]
        out[r] = (scores.softmax(0)[..., None] * values).sum(0)
        mass[r] = (scores.softmax(0)[..., None] * values.abs()).sum(0)
    return out, mass


def check(lens, page_size, ratio, dim, pool_dtype, q_dtype) -> None:
    q, k, v, table, seq_lens = make_case(lens, page_size, ratio, dim, pool_dtype)
    q = q.to(q_dtype)
    out = OPS.decode_attention(q, k, v, table, seq_lens, dim**-0.5)
    assert out.shape == q.shape and out.dtype == q_dtype
    ref, mass = reference(q, k, v, table, seq_lens, dim**-0.5)
    bound = RTOL[q_dtype] * ref.abs() + WEIGHT_RTOL[q_dtype] * mass + ATOL
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"error exceeds its bound by {worst}"


LENS = [1, 17, 16, 40, 3, 63]  # 1, lengths that are and are not multiples of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 7])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_matches_reference(dim: int, page_size: int, ratio: int, dtype: torch.dtype) -> None:
    check(LENS, page_size, ratio, dim, dtype, dtype)


@pytest.mark.parametrize("dim", [64, 48])
def test_long_contexts_split_over_threads(dim: int) -> None:
    """Past ~1,200 keys the (request, kv head) items are shared among threads; lengths differ across requests."""
    check([2000, 1, 517], 16, 7, dim, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize(("pool_dtype", "q_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_q_and_pool_dtypes_may_differ(pool_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    check(LENS, 16, 7, 64, pool_dtype, q_dtype)


def test_strided_q_and_empty_requests() -> None:
    """q may be a view (rows of a wider projection output); a request of no keys gets zeros."""
    q, k, v, table, lens = make_case([5, 0, 20], 16, 7, 64, torch.float32)
    wide = torch.cat([q, torch.randn_like(q)], 1)[:, : q.shape[1]]  # row stride twice the heads
    out = OPS.decode_attention(wide, k, v, table, lens, 0.125)
    torch.testing.assert_close(out, OPS.decode_attention(q.contiguous(), k, v, table, lens, 0.125))
    assert not out[1].any()
    assert torch.allclose(out[0].double(), reference(q, k, v, table, lens, 0.125)[0][0], atol=ATOL)


def test_bad_inputs_raise() -> None:
    q, k, v, table, lens = make_case([5, 20], 16, 7, 64, torch.float32)
    with pytest.raises(RuntimeError, match="exceeds its pages"):
        OPS.decode_attention(q, k, v, table, torch.tensor([5, 33], dtype=torch.int32), 0.125)
    bad = table.clone()
    bad[1, 1] = k.shape[0]
    with pytest.raises(RuntimeError, match="is not a pool page"):
        OPS.decode_attention(q, k, v, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        OPS.decode_attention(q, k, v, table.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        OPS.decode_attention(q[:, :13], k, v, table, lens, 0.125)


@pytest.mark.parametrize("march", ["haswell", "x86-64", "skylake-avx512"])
def test_other_instruction_sets(march: str) -> None:
    """The AVX2 (haswell: decode_attention_avx2.h), plain C++ (x86-64) and AVX-512 without BF16 (skylake-avx512:
    the path bfloat16 pages take where decode_attention_bf16.h is not built) builds through the same checks and the
    int8 pages' one, compiled here and run in a fresh process (one library per process registers the ops); this
    CPU's own path runs above."""
    have = set(radixserve_kernels.cpu.cpu_flags().split())
    if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
        pytest.skip("this CPU cannot run an AVX-512 build")
    int8_pages = "tests/test_kv_quant.py::test_cpu_op_reads_int8_pages_as_their_dequantized_values"
    failure = failure_on_build(march, [__file__, int8_pages], "not other_instruction")
    assert failure is None, failure
