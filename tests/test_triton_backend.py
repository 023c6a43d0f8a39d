"""The `triton` attention backend against the `torch` reference: one layer step at a time, then the whole engine.

Without a GPU the kernels run in the Triton interpreter (slow but exact in float32), so the engine runs stay tiny.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

# Without a GPU, conftest.py has set TRITON_INTERPRET=1 before any kernel is imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from radixserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402

NUM_KV_HEADS = 2
NUM_LAYERS = 2
# Both backends round once to the output dtype; they differ in summation order and, in 16-bit, in where the
# softmax weights are rounded, so the bound is about two output roundings.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(2**31)


def twin_pools(
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[KVPool, KVPool]:
    """Two pools with the same random contents in every page (stale values a wrong read would pick up)."""
    pools = [KVPool(NUM_LAYERS, num_pages, page_size, NUM_KV_HEADS, head_dim, dtype, DEVICE) for _ in range(2)]
    for layer in range(NUM_LAYERS):
        for bufs in ("k_buffers", "v_buffers"):
            values = torch.randn(getattr(pools[0], bufs)[layer].shape, generator=gen).to(dtype)
            for pool in pools:
                getattr(pool, bufs)[layer].copy_(values)
    return pools[0], pools[1]


def random_batch(lens: list[tuple[int, int]], page_size: int, num_pages: int, gen: torch.Generator) -> ForwardBatch:
    """A batch of requests with (prefix, extend) lengths over distinct shuffled pages."""
    need = [math.ceil((p + e) / page_size) for p, e in lens]
    pages = (torch.randperm(num_pages - 1, generator=gen)[: sum(need)] + 1).tolist()
    tables = []
    for n in need:
        tables.append(pages[:n])
        del pages[:n]
    chunks = [[7] * e for _, e in lens]
    return ForwardBatch.build(chunks, [p for p, _ in lens], tables, page_size, [0], DEVICE)


CASES = [  # (dtype, page_size, gqa_ratio, head_dim)
    (torch.float32, 16, 7, 64),
    (torch.float16, 1, 4, 128),
    (torch.bfloat16, 16, 1, 128),
]
BATCHES = {
    # prefix 0, single new tokens after mid-page prefixes (a mixed prefill + decode step), a chunk ending mid-page
    "mixed": [(0, 5), (19, 1), (33, 1), (16, 21)],
    "decode": [(0, 1), (16, 1), (39, 1)],
}


@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize(
    "dtype,page_size,group,head_dim", CASES, ids=[f"{str(d).split('.')[-1]}-ps{p}-gqa{g}-d{h}" for d, p, g, h in CASES]
)
def test_layer_steps_match_torch_backend(
    dtype: torch.dtype, page_size: int, group: int, head_dim: int, batch_kind: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    lens = BATCHES[batch_kind]
    num_pages = 3 + sum(math.ceil((p + e) / page_size) for p, e in lens)
    ref_pool, pool = twin_pools(num_pages, page_size, head_dim, dtype, gen)
    batch = random_batch(lens, page_size, num_pages, gen)
    heads = NUM_KV_HEADS * group
    ref = TorchAttentionBackend(ref_pool, heads, head_dim)
    tri = TritonAttentionBackend(pool, heads, head_dim)
    ref.plan(batch)
    tri.plan(batch)
    assert tri.is_decode == (batch_kind == "decode")
    tokens = batch.num_tokens
    for layer in range(NUM_LAYERS):
        q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        k = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
        v = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
        expect = ref.forward(layer, q, k, v).double()
        out = tri.forward(layer, q, k, v, out=torch.full_like(q, float("nan"))).double()
        tol = TOLERANCE[dtype]
        err = (out - expect).abs()
        bad = ~(err <= tol + tol * expect.abs())
        assert not bad.any(), f"layer {layer}: {int(bad.sum())} bad, max error {err.max().item():.3g} (seed={seed})"
        # The KV store is a copy: both pools hold bit-identical pages afterwards.
        assert torch.equal(pool.k_buffers[layer], ref_pool.k_buffers[layer]), f"seed={seed}"
        assert torch.equal(pool.v_buffers[layer], ref_pool.v_buffers[layer]), f"seed={seed}"


def test_backend_rejects_bad_setups(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixserve.attention.triton_backend as tb

    pool = KVPool(1, 4, 16, NUM_KV_HEADS, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        TritonAttentionBackend(pool, 3, 64)
    cpu_pool = KVPool(1, 4, 16, NUM_KV_HEADS, 64, torch.float32, "cpu")
    monkeypatch.setattr(tb, "is_interpreted", lambda kernel: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tb.TritonAttentionBackend(cpu_pool, 4, 64)


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 1])
def test_engine_greedy_matches_torch_backend(page_size: int, tiny_model_factory, make_engine) -> None:
    """Same tokens and log-probs as `torch`, through chunked prefill, a mixed batch and radix cache hits."""
    # 14 query heads over 2 KV heads: the GQA ratio 7 of the default model.
    model_dir = tiny_model_factory("qwen2", num_attention_heads=14, num_key_value_heads=2)
    rng = random.Random(page_size)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 17, 70)]  # 70 > chunk: chunked prefill
    prompts += [shared + [5, 6, 7], shared + [9]]  # the second run of these hits the cache mid-sequence
    results = {}
    for backend in ("torch", "triton"):
        eng = make_engine(
            model_dir,
            attention_backend=backend,
            page_size=page_size,
            chunked_prefill_size=32,
            max_total_tokens=1024,
            device=DEVICE,
        )
        runs = [eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True) for _ in range(2)]
        assert eng.cache_stats()["hit_tokens"] >= 2 * 32, "the second run must be served from the cache"
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in runs[1][3:])
        results[backend] = runs
    for run in range(2):
        for i, (ref, out) in enumerate(zip(results["torch"][run], results["triton"][run])):
            assert out["output_ids"] == ref["output_ids"], f"run {run}, prompt {i}"
            got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _ in ref["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-4), f"run {run}, prompt {i}"


@pytest.mark.parametrize("pages", ["int8", "bfloat16"])
@pytest.mark.parametrize("batch_kind", list(BATCHES))
def test_int8_or_bfloat16_pages_match_the_torch_backend(batch_kind: str, pages: str, seed: int) -> None:
    """int8 KV pages (radixserve/cache/kv_format.py): both kernels decode rows and scales as the torch reference
    does, and the new tokens are quantized into the same bytes. bfloat16 pages under float32 activations (what auto
    stores without bf16 hardware): the new tokens rounded to nearest even as torch rounds them, and attended so."""
    from radixserve.cache.kv_format import KVFormat

    gen = torch.Generator().manual_seed(seed)
    lens, page_size, head_dim, group = BATCHES[batch_kind], 16, 64, 7
    num_pages = 3 + sum(math.ceil((p + e) / page_size) for p, e in lens)
    fmt = KVFormat(pages)
    pools = [KVPool(NUM_LAYERS, num_pages, page_size, NUM_KV_HEADS, head_dim, torch.float32, DEVICE, fmt) for _ in "ab"]
    for layer in range(NUM_LAYERS):
        for bufs, kind in (("k_buffers", "k"), ("v_buffers", "v")):  # keys a scale per 16, values one a row
            shape = getattr(pools[0], bufs)[layer].shape[:-1] + (head_dim,)
            rows = fmt.encode(torch.randn(shape, generator=gen) * 3, kind)
            for pool in pools:
                getattr(pool, bufs)[layer].copy_(rows)
    batch = random_batch(lens, page_size, num_pages, gen)
    heads = NUM_KV_HEADS * group
    ref, tri = TorchAttentionBackend(pools[0], heads, head_dim), TritonAttentionBackend(pools[1], heads, head_dim)
    ref.use_cpu_kernels = False  # the SDPA path: the C++ op's int8 reads are tests/test_kv_quant.py's
    ref.plan(batch)
    tri.plan(batch)
    for layer in range(NUM_LAYERS):
        q, k, v = (
            torch.randn(batch.num_tokens, n, head_dim, generator=gen).to(DEVICE)
            for n in (heads, NUM_KV_HEADS, NUM_KV_HEADS)
        )
        expect = ref.forward(layer, q, k, v)
        out = tri.forward(layer, q, k, v, out=torch.full_like(q, float("nan")))
        torch.testing.assert_close(out, expect, rtol=TOLERANCE[torch.float32], atol=TOLERANCE[torch.float32])
        assert torch.equal(pools[0].k_buffers[layer], pools[1].k_buffers[layer])
        assert torch.equal(pools[0].v_buffers[layer], pools[1].v_buffers[layer])
