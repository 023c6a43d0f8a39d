"""TorchAttentionBackend alone against a naive per-request, per-token attention in float64: its SDPA paths, and on CPU
its decode group through the fused C++ op (radixserve_kernels/cpu/decode_attention.cpp) where that builds."""

from __future__ import annotations

import random

import pytest
import torch

import radixserve_kernels.cpu
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

KV_HEADS, HEAD_DIM, NUM_LAYERS = 2, 16, 2
# Max abs error of outputs (values are O(1)): float32 is exact up to summation order; bfloat16 inputs and
# outputs carry ~3 significant digits, and the reference sees the same bf16-rounded inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

MIXED = [(0, 1), (0, 17), (5, 1), (16, 1), (31, 9), (13, 40), (0, 16), (47, 1), (3, 2)]  # (prefix, extend)
DECODE = [(0, 1), (1, 1), (15, 1), (16, 1), (17, 1), (40, 1), (63, 1)]
EXTEND = [(0, 33), (16, 16), (7, 2), (20, 5)]
SINGLE = [(29, 1)]
PREFILL = [(0, 33), (0, 7), (0, 16)]  # fresh prompts only: the unmasked causal path
PREFILL_AND_DECODE = [(0, 20), (9, 1), (0, 3)]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """q `[E, H, D]` of tokens at positions prefix.., k/v `[prefix + E, KV, D]` -> `[E, H, D]`, one token at a time."""
    ratio = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(ratio, dim=1), v.double().repeat_interleave(ratio, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = prefix + i + 1
        scores = (q[i].double()[None] * k[:visible]).sum(-1) * scale  # [visible, H]
        out[i] = (scores.softmax(0)[..., None] * v[:visible]).sum(0)
    return out


def run_case(
    specs: list[tuple[int, int]], page_size: int, ratio: int, dtype: torch.dtype, cpu_op: bool = False, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = KV_HEADS * ratio
    num_pages = 1 + sum((p + e + page_size - 1) // page_size for p, e in specs) + 3
    pool = KVPool(NUM_LAYERS, num_pages, page_size, KV_HEADS, HEAD_DIM, dtype)
    backend = TorchAttentionBackend(pool, heads, HEAD_DIM)
    backend.use_cpu_kernels = cpu_op
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)  # non-contiguous, non-monotonic page ids

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tables, full_k, full_v = [], [], []
    for prefix, ext in specs:
        tables.append([free.pop() for _ in range((prefix + ext + page_size - 1) // page_size)])
        full_k.append({layer: randn(prefix + ext, KV_HEADS, HEAD_DIM) for layer in range(NUM_LAYERS)})
        full_v.append({layer: randn(prefix + ext, KV_HEADS, HEAD_DIM) for layer in range(NUM_LAYERS)})
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], tables, page_size, [])
    # The prefix K/V sit in the pool already, as an earlier step (or the radix cache) left them.
    for layer in range(NUM_LAYERS):
        for (prefix, _), table, k, v in zip(specs, tables, full_k, full_v):
            slots = torch.tensor(
                [table[t // page_size] * page_size + t % page_size for t in range(prefix)], dtype=torch.int64
            )
            pool.store(layer, slots, k[layer][:prefix], v[layer][:prefix])
    backend.plan(batch)
    decode_on_op = [g.table is not None for g in backend.groups if g.q_len == 1]
    assert decode_on_op == [cpu_op] * len(decode_on_op)
    for layer in range(NUM_LAYERS):
        q = randn(batch.num_tokens, heads, HEAD_DIM)
        new_k = torch.cat([k[layer][p:] for (p, _), k in zip(specs, full_k)])
        new_v = torch.cat([v[layer][p:] for (p, _), v in zip(specs, full_v)])
        out = backend.forward(layer, q, new_k, new_v)
        assert out.shape == q.shape and out.dtype == dtype
        for r, (prefix, ext) in enumerate(specs):
            rows = slice(int(batch.qo_indptr[r]), int(batch.qo_indptr[r + 1]))
            ref = naive_attention(q[rows], full_k[r][layer], full_v[r][layer], prefix, HEAD_DIM**-0.5)
            err = (out[rows].double() - ref).abs().max().item()
            assert err < TOL[dtype], f"layer {layer} request {r} (prefix {prefix}, extend {ext}): max abs error {err}"
        # The new K/V were written at out_cache_loc of this layer's buffers.
        k_flat = pool.k_buffers[layer].view(-1, KV_HEADS, HEAD_DIM)
        assert torch.equal(k_flat[batch.out_cache_loc], new_k)


@pytest.mark.parametrize(
    "cpu_op",
    [
        False,
        pytest.param(
            True, marks=pytest.mark.skipif(radixserve_kernels.cpu.ops() is None, reason="CPU kernels unavailable")
        ),
    ],
    ids=["sdpa", "cpu_op"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 4, 7])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "specs",
    [MIXED, DECODE, EXTEND, SINGLE, PREFILL, PREFILL_AND_DECODE],
    ids=["mixed", "decode", "extend", "single", "prefill", "prefill+decode"],
)
def test_matches_naive_attention(
    specs: list[tuple[int, int]], page_size: int, ratio: int, dtype: torch.dtype, cpu_op: bool
) -> None:
    run_case(specs, page_size, ratio, dtype, cpu_op)
