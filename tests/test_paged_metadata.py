"""FlashInfer-style metadata (radixserve/attention/paged_metadata.py) against what the torch backend attends to.

Each request's key slots are rebuilt from kv_indptr / kv_indices / kv_last_page_len the way FlashInfer reads them,
and must equal, query row by query row, the slots the torch backend's plan gathers and leaves unmasked. A reference
attention that sees only the metadata must also give the torch backend's outputs. CPU only, no flashinfer needed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import radixserve_kernels.cpu
from radixserve.attention.paged_metadata import PagedKVMetadata, build_paged_metadata, kv_indices, kv_last_page_len
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

KV_HEADS, HEAD_DIM = 2, 16

BATCHES = {  # (prefix, extend) per request
    "decode": [(0, 1), (15, 1), (16, 1), (17, 1), (40, 1), (63, 1)],
    "mixed": [(0, 5), (19, 1), (33, 1), (16, 21), (0, 16), (47, 1), (3, 2)],
    "fresh_prefill": [(0, 33), (0, 7), (0, 16)],
    "extend_after_prefix": [(16, 16), (7, 2), (31, 9)],
    # Every request starts with the same 32 cached tokens (the same pages, as the radix cache hands them out).
    "shared_prefix": [(32, 1), (32, 5), (40, 1), (33, 12), (47, 1)],
}
SHARED_TOKENS = {"shared_prefix": 32}


def make_batch(lens: list[tuple[int, int]], page_size: int, seed: int, shared_tokens: int = 0) -> ForwardBatch:
    """Requests over shuffled pages; the pages of the first `shared_tokens` tokens are the same for every request."""
    rng = random.Random(seed)
    need = [math.ceil((p + e) / page_size) for p, e in lens]
    free = list(range(1, 1 + sum(need) + 4))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_tokens // page_size)]
    tables = [shared + [free.pop() for _ in range(n - len(shared))] for n in need]
    chunks = [[rng.randrange(100) for _ in range(e)] for _, e in lens]
    return ForwardBatch.build(chunks, [p for p, _ in lens], tables, page_size, list(range(sum(e for _, e in lens))))


def flashinfer_key_slots(meta: PagedKVMetadata) -> list[list[int]]:
    """Each request's key slots in position order, read as FlashInfer reads paged KV: full pages, then a last page
    holding kv_last_page_len tokens."""
    ps, out = meta.page_size, []
    for i in range(meta.batch_size):
        pages = meta.kv_indices[int(meta.kv_indptr[i]) : int(meta.kv_indptr[i + 1])].tolist()
        slots = []
        for j, page in enumerate(pages):
            used = int(meta.kv_last_page_len[i]) if j == len(pages) - 1 else ps
            slots += [page * ps + o for o in range(used)]
        out.append(slots)
    return out


def torch_backend_visible_slots(batch: ForwardBatch, cpu_op: bool) -> dict[int, list[set[int]]]:
    """Per request, per query row: the pool slots whose keys the torch backend's plan gathers and leaves unmasked
    (cpu_op: with its decode group on the C++ op where that builds)."""
    pool = KVPool(1, int(batch.page_table.max()) + 1, batch.page_size, KV_HEADS, HEAD_DIM, torch.float32)
    backend = TorchAttentionBackend(pool, KV_HEADS, HEAD_DIM)
    backend.use_cpu_kernels = cpu_op
    backend.plan(batch)
    ext = batch.extend_lens.long()
    members = [m for m in (torch.nonzero(ext == 1).flatten(), torch.nonzero(ext > 1).flatten()) if m.numel()]
    assert len(members) == len(backend.groups)
    ps, visible = batch.page_size, {}
    for reqs, g in zip(members, backend.groups):
        # The decode group on the CPU op (radixserve_kernels/cpu/decode_attention.cpp) reads keys 0..seq_len-1 of its
        # table.
        pages = g.pages.view(g.num_reqs, -1) if g.table is None else g.table
        for gi, r in enumerate(reqs.tolist()):
            rows = []
            for qi in range(int(ext[r])):
                if g.table is not None:
                    keys = range(int(g.seq_lens[gi]))
                elif g.causal:  # fresh prefill: keys 0..q_len-1 of the request under a causal mask
                    keys = range(qi + 1)
                else:
                    assert g.bias is not None
                    keys = torch.nonzero(g.bias[gi, 0, qi] == 0).flatten().tolist()
                rows.append({int(pages[gi, j // ps]) * ps + j % ps for j in keys})
            visible[r] = rows
    return visible


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
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_metadata_keys_equal_torch_backend_keys(kind: str, page_size: int, cpu_op: bool) -> None:
    lens = BATCHES[kind]
    batch = make_batch(lens, page_size, seed=page_size, shared_tokens=SHARED_TOKENS.get(kind, 0))
    meta = build_paged_metadata(batch)
    assert torch.equal(meta.qo_indptr, batch.qo_indptr.to(torch.int32))
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len):
        assert t.dtype == torch.int32
    assert meta.kv_indices.numel() == int(meta.kv_indptr[-1])
    assert bool(((meta.kv_last_page_len >= 1) & (meta.kv_last_page_len <= page_size)).all())
    slots = flashinfer_key_slots(meta)
    visible = torch_backend_visible_slots(batch, cpu_op)
    for r, (prefix, extend) in enumerate(lens):
        assert len(slots[r]) == prefix + extend == int(batch.seq_lens[r])
        # The new tokens' slots are the last ones of the request's keys, in order.
        new = batch.out_cache_loc[int(batch.qo_indptr[r]) : int(batch.qo_indptr[r + 1])].tolist()
        assert slots[r][prefix:] == new
        for qi in range(extend):
            # FlashInfer's causal mask is aligned to the end of the keys: query qi sees keys 0..prefix+qi.
            assert set(slots[r][: prefix + qi + 1]) == visible[r][qi], f"request {r} query {qi}"


def reference_paged_attention(
    meta: PagedKVMetadata,
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention in float64 from the metadata alone: request i's queries are its last q_len key positions."""
    k_flat = pool.k_buffers[layer].reshape(-1, KV_HEADS, HEAD_DIM).double()
    v_flat = pool.v_buffers[layer].reshape(-1, KV_HEADS, HEAD_DIM).double()
    ratio = q.shape[1] // KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, slots in enumerate(flashinfer_key_slots(meta)):
        k = k_flat[slots].repeat_interleave(ratio, dim=1)
        v = v_flat[slots].repeat_interleave(ratio, dim=1)
        lo, hi = int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1])
        for row in range(lo, hi):
            visible = len(slots) - (hi - row) + 1
            scores = (q[row].double()[None] * k[:visible]).sum(-1) * scale
            out[row] = (scores.softmax(0)[..., None] * v[:visible]).sum(0)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["mixed", "decode", "shared_prefix"])
def test_attention_from_metadata_matches_torch_backend(kind: str, page_size: int) -> None:
    gen = torch.Generator().manual_seed(7)
    batch = make_batch(BATCHES[kind], page_size, seed=3, shared_tokens=SHARED_TOKENS.get(kind, 0))
    heads = KV_HEADS * 4
    pool = KVPool(1, int(batch.page_table.max()) + 2, page_size, KV_HEADS, HEAD_DIM, torch.float32)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))  # stale values everywhere
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    backend = TorchAttentionBackend(pool, heads, HEAD_DIM)
    backend.plan(batch)
    q = torch.randn(batch.num_tokens, heads, HEAD_DIM, generator=gen)
    k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    out = backend.forward(0, q, k, v)  # writes k/v into the pool, as the flashinfer backend does before attending
    ref = reference_paged_attention(build_paged_metadata(batch), pool, 0, q, HEAD_DIM**-0.5)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_last_page_len_and_indices_edges() -> None:
    lens = torch.tensor([1, 15, 16, 17, 32, 0], dtype=torch.int32)
    assert kv_last_page_len(lens, 16).tolist() == [1, 15, 16, 1, 16, 0]
    assert kv_last_page_len(lens, 1).tolist() == [1, 1, 1, 1, 1, 0]
    table = torch.tensor([[5, 6, 0], [7, 8, 9]], dtype=torch.int32)
    assert kv_indices(table, torch.tensor([17, 33]), 16).tolist() == [5, 6, 7, 8, 9]
    assert kv_indices(table, torch.tensor([0, 1]), 16).tolist() == [7]
    with pytest.raises(ValueError, match="pages per request"):
        kv_indices(table, torch.tensor([49, 1]), 16)


def test_empty_batch() -> None:
    meta = build_paged_metadata(ForwardBatch.build([], [], [], 16, []))
    assert meta.batch_size == 0
    assert meta.kv_indptr.tolist() == [0] and meta.qo_indptr.tolist() == [0] and meta.kv_indices.numel() == 0
