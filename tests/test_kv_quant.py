"""Quantized KV pages (radixserve/cache/kv_format.py, issue 40): each format's round-trip error within its bound;
the pool stores, copies, gathers and scatters int8 rows with their scales; attention over int8 / fp8 pages equals
attention over the dequantized float pages (same inputs) on every CPU path: the torch backend's SDPA path (decode,
prefill and mixed steps) and the C++ decode op (AVX-512 head_dim 64 and 128, the plain path at 32); the budget
sizes the pool by format; an engine on int8 pages runs, its disk tier returns the same bytes (identical greedy output
with the tier on and off) and its outputs stay close to float KV."""

from __future__ import annotations

import random

import pytest
import torch

import radixserve_kernels.cpu
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_format import VALUE_SIGNS, KVFormat, resolve_kv_dtype, row_scales, scale_group
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

OPS = radixserve_kernels.cpu.ops()
needs_ops = pytest.mark.skipif(OPS is None, reason="CPU kernels unavailable")
KV_HEADS = 2
# int8 rows of head_dim 64: the values, then a 2-byte scale per group (keys per 16: 72 bytes; values one: 66)
KW64, VW64 = KVFormat("int8").key_width(64), KVFormat("int8").value_width(64)


def _rows(seed: int = 0, n: int = 200, dim: int = 64) -> torch.Tensor:
    """Rows with a spread of magnitudes (1e-3 .. 1e2), outliers and an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, KV_HEADS, dim, generator=gen) * torch.logspace(-3, 2, n)[:, None, None]
    x[3, 0, 5] = 300.0  # an outlier in one row
    x[7] = 0.0
    return x


def _step_bound(x: torch.Tensor, kind: str = "k") -> torch.Tensor:
    """Half a quantization step of each value's group (max / 127), plus the float16 rounding of the scale
    (2^-11 relative) where the clamp absorbs it."""
    g = scale_group(x.shape[-1], kind)
    amax = x.unflatten(-1, (-1, g)).abs().amax(-1, keepdim=True)
    return (0.5 * amax / 127 + amax * 2**-10 + 1e-30).expand(*x.shape[:-1], x.shape[-1] // g, g).flatten(-2)


@pytest.mark.parametrize(("kind", "width", "groups"), [("k", 72, 4), ("v", 66, 1)])
def test_int8_round_trip_error_is_within_half_a_step_of_its_group(kind: str, width: int, groups: int) -> None:
    """Keys carry a scale per 16 values, values one per row: each within half a step of its own group."""
    fmt = KVFormat("int8")
    x = _rows()
    stored = fmt.encode(x, kind)
    assert stored.dtype == torch.int8 and stored.shape == (*x.shape[:-1], width) == (*x.shape[:-1], 64 + 2 * groups)
    back = fmt.decode(stored, torch.float32, kind)
    assert ((back - x).abs() <= _step_bound(x, kind)).all()
    assert row_scales(stored, kind).shape == (*x.shape[:-1], groups)
    assert not back[7].any() and (row_scales(stored[7], kind) == 0).all()
    assert (stored[..., :64].abs() <= 127).all()
    if kind == "v":  # one scale: a row's small values lose to its largest (the outlier at [3, 0, 5] above all)
        assert ((back - x).abs()[3, 0] > _step_bound(x, "k")[3, 0]).any()
    with pytest.raises(ValueError, match="a key"):
        fmt.encode(x, "kv")


@pytest.mark.parametrize("kind", ["k", "v"])
def test_int8_rows_round_trip_through_the_rotation(kind: str) -> None:
    """Rows are stored rotated, keys by H, values by H S (S: VALUE_SIGNS' channels negated; both orthonormal, the
    fast transform equals the matrix product, H is its own inverse): rotating back gives them within the rotated
    rows' error, in norm (the rotations preserve norms)."""
    fmt = KVFormat("int8")
    x = _rows()
    x[:, :, 9] += 40.0  # a large channel in every row, as Qwen2.5's keys have
    rotate, back_of = (fmt.rotate, fmt.rotate) if kind == "k" else (fmt.rotate_values, fmt.unrotate_values)
    rotated = rotate(x)
    h = torch.ones(1, 1)
    while h.shape[0] < 64:  # Sylvester's construction of the Walsh-Hadamard matrix
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.ones(64) if kind == "k" else torch.tensor([-1.0 if VALUE_SIGNS >> d & 1 else 1.0 for d in range(64)])
    torch.testing.assert_close(rotated, (x * signs) @ h / 8, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(back_of(rotated), x, rtol=1e-6, atol=1e-4)
    back = back_of(fmt.decode(fmt.encode(rotated, kind), torch.float32, kind))
    assert ((back - x).norm(dim=-1) <= _step_bound(rotated, kind).norm(dim=-1) * 1.0001).all()


@pytest.mark.parametrize("cpu_op", [False, pytest.param(True, marks=needs_ops)], ids=["sdpa", "cpu_op"])
def test_a_value_row_with_a_large_channel_keeps_its_small_ones(cpu_op: bool) -> None:
    """One scale per value row: unrotated, a large channel (as Qwen2.5's values have in some heads) would set the
    step of all 64 and leave the small ones an error of up to 40 / 254 each. Rotated, the row's error is the
    rotated row's, in norm. Attention over a single key returns its value row, so each reader's output shows it."""
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, 2, 16, KV_HEADS, 64, torch.float32, kv_format=KVFormat("int8"))
    v = torch.randn(1, KV_HEADS, 64, generator=gen)
    v[..., 9] = 40.0
    got = _attend(pool, [(0, 1)], torch.randn(1, KV_HEADS * 7, 64, generator=gen), v, v, [[1]], cpu_op)
    err = (got.view(KV_HEADS, 7, 64) - v.view(KV_HEADS, 1, 64)).norm(dim=-1)
    bound = _step_bound(pool.format.rotate_values(v), "v").norm(dim=-1).view(KV_HEADS, 1)
    assert (err <= bound * 1.0001 + 1e-5).all() and (bound < 0.5).all()  # unrotated: ~0.7 (63 errors of ~0.09 rms)


@pytest.mark.parametrize(
    ("name", "rel"), [("float32", 0.0), ("bfloat16", 2**-8), ("float16", 2**-11), ("fp8_e4m3", 2**-4)]
)
def test_float_formats_round_trip_within_half_an_ulp(name: str, rel: float) -> None:
    fmt = KVFormat(name)
    x = _rows() * 0.5  # within fp8's normal range, below its 448 clamp (and float16's, at 1e-3 * 0.5 and above)
    x = torch.where(x.abs() < 2**-6, torch.full_like(x, 0.25), x)  # no subnormal fp8 values: their bound differs
    for kind in ("k", "v"):
        back = fmt.decode(fmt.encode(x, kind), torch.float32, kind)
        assert ((back - x).abs() <= rel * x.abs()).all()


def test_fp8_clamps_to_its_largest_value_instead_of_nan() -> None:
    fmt = KVFormat("fp8_e4m3")
    back = fmt.decode(fmt.encode(torch.tensor([1e4, -1e4, 3.0]), "v"), torch.float32, "v")
    assert back.tolist() == [448.0, -448.0, 3.0]


def test_auto_keeps_the_model_dtype_and_a_bad_name_raises() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_dtype("int8", torch.bfloat16).storage == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVFormat("int4")


def test_int8_holds_about_twice_the_tokens_of_bfloat16_in_the_same_bytes() -> None:
    """138 bytes a K/V row pair at head_dim 64 (72 + 66) against bfloat16's 256: 1.86x the tokens."""
    bf16, int8 = (KVFormat(n).bytes_per_token(24, 2, 64) for n in ("bfloat16", "int8"))
    assert (KW64, VW64) == (72, 66) and bf16 == 2 * 24 * 2 * 64 * 2 and int8 == 24 * 2 * 138
    assert bf16 / int8 > 1.85
    assert KVFormat("bfloat16").key_width(64) == KVFormat("bfloat16").value_width(64) == 64
    with pytest.raises(ValueError, match="power of two"):
        KVPool(1, 4, 16, KV_HEADS, 48, torch.float32, kv_format=KVFormat("int8"))


def test_pool_moves_int8_rows_with_their_scales() -> None:
    pool = KVPool(2, 6, 4, KV_HEADS, 64, torch.bfloat16, kv_format=KVFormat("int8"))
    assert pool.k_buffers[0].shape == (6, 4, KV_HEADS, KW64) and pool.v_buffers[0].shape == (6, 4, KV_HEADS, VW64)
    assert pool.bytes_per_token == 2 * KV_HEADS * 138 and pool.page_shape == (2, 4, KV_HEADS, 138)
    x = _rows(n=8)
    loc = torch.arange(4, 12)
    for layer in range(2):
        pool.store(layer, loc, x * (layer + 1), -x)
    flat = pool.k_buffers[1].view(-1, KV_HEADS, KW64)
    vflat = pool.v_buffers[1].view(-1, KV_HEADS, VW64)
    fmt = KVFormat("int8")
    assert torch.equal(flat[loc], fmt.encode(fmt.rotate(x * 2), "k"))  # rows rotated, then quantized
    assert torch.equal(vflat[loc], fmt.encode(fmt.rotate_values(-x), "v"))
    pool.copy_slots(torch.tensor([4, 5]), torch.tensor([13, 14]))  # a partial-page copy keeps the bytes
    assert torch.equal(flat[13:15], flat[4:6]) and torch.equal(vflat[13:15], vflat[4:6])
    pages = torch.tensor([1, 2])
    kv = pool.gather_pages(pages)  # each KV head's key row then its value row
    assert kv.shape == (2, *pool.page_shape)
    assert torch.equal(kv[:, 1, ..., :KW64], pool.k_buffers[1][1:3]) and torch.equal(
        kv[:, 1, ..., KW64:], pool.v_buffers[1][1:3]
    )
    other = KVPool(2, 6, 4, KV_HEADS, 64, torch.bfloat16, kv_format=KVFormat("int8"))
    other.scatter_pages(torch.tensor([4, 5]), kv)  # what the tiers do
    assert torch.equal(other.gather_pages(torch.tensor([4, 5])), kv)
    assert torch.equal(other.v_buffers[1][4:6], pool.v_buffers[1][1:3])


def _dequantized_pool(pool: KVPool) -> KVPool:
    """A float32 pool holding exactly the values `pool`'s rows decode to (rotated back)."""
    out = KVPool(len(pool.k_buffers), pool.num_pages, pool.page_size, KV_HEADS, pool.head_dim, torch.float32)
    for src, dst in zip(pool.k_buffers, out.k_buffers):
        dst.copy_(pool.format.rotate(pool.format.decode(src, torch.float32, "k")))
    for src, dst in zip(pool.v_buffers, out.v_buffers):
        dst.copy_(pool.format.unrotate_values(pool.format.decode(src, torch.float32, "v")))
    return out


def _attend(pool: KVPool, specs, q, new_k, new_v, tables, cpu_op: bool) -> torch.Tensor:
    backend = TorchAttentionBackend(pool, q.shape[1], pool.head_dim)
    backend.use_cpu_kernels = cpu_op
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], tables, pool.page_size, [])
    backend.plan(batch)
    assert [g.table is not None for g in backend.groups if g.q_len == 1] in ([], [cpu_op])
    return backend.forward(0, q, new_k, new_v)


MIXED = [(0, 1), (0, 17), (5, 1), (16, 1), (31, 9), (13, 40), (47, 1)]  # (prefix, extend): decode and prefill
DECODE = [(1, 1), (17, 1), (63, 1), (200, 1)]


@pytest.mark.parametrize(
    ("fmt", "cpu_op"),
    # The C++ op reads float32, bfloat16 and int8 pages; fp8 decodes on the SDPA path.
    [("int8", False), pytest.param("int8", True, marks=needs_ops), ("fp8_e4m3", False)],
    ids=["int8-sdpa", "int8-cpu_op", "fp8-sdpa"],
)
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_attention_over_quantized_pages_equals_attention_over_the_dequantized_pages(
    specs, fmt: str, cpu_op: bool, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    ps, heads = 16, KV_HEADS * 7
    num_pages = 1 + sum((p + e + ps - 1) // ps for p, e in specs) + 2
    quant = KVPool(1, num_pages, ps, KV_HEADS, head_dim, torch.float32, kv_format=KVFormat(fmt))
    free = list(range(1, num_pages))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range((p + e + ps - 1) // ps)] for p, e in specs]
    for (prefix, _), table in zip(specs, tables):  # the prefixes, as earlier steps left them
        slots = torch.tensor([table[t // ps] * ps + t % ps for t in range(prefix)], dtype=torch.int64)
        quant.store(0, slots, *(torch.randn(prefix, KV_HEADS, head_dim, generator=gen) * 3 for _ in range(2)))
    floats = _dequantized_pool(quant)
    tokens = sum(e for _, e in specs)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    new_k, new_v = (torch.randn(tokens, KV_HEADS, head_dim, generator=gen) * 3 for _ in range(2))
    got = _attend(quant, specs, q, new_k, new_v, tables, cpu_op)
    # The float pool gets the new rows as the quantized pool will read them back (rotated back).
    f = quant.format
    fk = f.rotate(f.decode(f.encode(f.rotate(new_k), "k"), torch.float32, "k"))
    fv = f.unrotate_values(f.decode(f.encode(f.rotate_values(new_v), "v"), torch.float32, "v"))
    want = _attend(floats, specs, q, fk, fv, tables, cpu_op)
    # atol: outputs near 0 are sums of values of ~3 that cancel, where the float32 rotations (there and back, 6
    # rounded stages each, of the keys and of the values or output) show as ~1e-5 (measured 1.2e-5 once in 62,720
    # outputs with the keys' alone).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-5)


@needs_ops
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_reads_int8_pages_as_their_dequantized_values(head_dim: int, q_dtype: torch.dtype) -> None:
    """The op alone, long enough (2,000 keys) to split over threads: int8 pages against the float32 pages they
    decode to, rotated back (over int8 pages the op rotates the query and its output itself), both through the op
    (AVX-512 at 64 and 128, the plain path at 32)."""
    gen = torch.Generator().manual_seed(2)
    fmt, ps, lens = KVFormat("int8"), 16, [2000, 1, 517]
    pages = [(n + ps - 1) // ps for n in lens]
    k, v = (fmt.encode(torch.randn(1 + sum(pages), ps, KV_HEADS, head_dim, generator=gen) * 2, c) for c in "kv")
    assert k.shape[-1] == head_dim * 9 // 8 and v.shape[-1] == head_dim + 2  # keys a scale per 16, values one
    perm = (torch.randperm(sum(pages), generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for r, (start, n) in enumerate(zip([0, *torch.tensor(pages).cumsum(0).tolist()], pages)):
        table[r, :n] = perm[start : start + n]
    q = torch.randn(len(lens), KV_HEADS * 7, head_dim, generator=gen).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = OPS.decode_attention(q, k, v, table, seq_lens, head_dim**-0.5)
    kf, vf = fmt.rotate(fmt.decode(k, torch.float32, "k")), fmt.unrotate_values(fmt.decode(v, torch.float32, "v"))
    want = OPS.decode_attention(q, kf, vf, table, seq_lens, head_dim**-0.5)
    tol = 1e-5 if q_dtype == torch.float32 else 2**-7  # bfloat16 outputs: one ulp, where the two round apart
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-5)
    with pytest.raises(RuntimeError, match="a 2-byte scale per group"):
        OPS.decode_attention(q, k[..., :-1].contiguous(), v[..., :-1].contiguous(), table, seq_lens, 0.1)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cpu_store_writes_the_encoders_bytes(dtype: torch.dtype) -> None:
    """radixserve_kernels/cpu/kv_store.cpp (what an int8 pool on CPU stores with) against KVFormat.encode, byte for
    byte, rows through `rotate` first (the op's fast transform runs the same float32 adds in the same order): rows with
    exact halves (round half to even), zeros, outliers, bfloat16 and float32 inputs."""
    fmt = KVFormat("int8")
    x = _rows(n=64).to(dtype)
    ties = torch.arange(64, dtype=torch.float32) - 31.5  # x.5 values: ties to round half to even
    ties[::16] = 127.0  # every group's scale exactly 1 (keys' groups of 16 and values' one), so x / scale is its tie
    # Stored rotated: the row whose rotation is `ties` (exact at 64: sums of halves, and 1/8 a power of two; in
    # bfloat16 that row rounds, so only float32 inputs carry the ties), as a key and (-x) as a value.
    x[1, 0] = fmt.rotate(ties).to(dtype)
    x[1, 1] = -fmt.unrotate_values(ties).to(dtype)
    assert dtype != torch.float32 or (
        torch.equal(fmt.rotate(x[1, 0]), ties) and torch.equal(fmt.rotate_values(-x[1, 1]), ties)
    )
    buf = [torch.zeros(20, 4, KV_HEADS, w, dtype=torch.int8) for w in (KW64, VW64)]
    loc = torch.randperm(80)[:64]
    OPS.store_kv_int8(x, -x, buf[0], buf[1], loc)
    assert torch.equal(buf[0].view(-1, KV_HEADS, KW64)[loc], fmt.encode(fmt.rotate(x), "k"))
    assert torch.equal(buf[1].view(-1, KV_HEADS, VW64)[loc], fmt.encode(fmt.rotate_values(-x), "v"))
    with pytest.raises(RuntimeError, match="not a pool slot"):
        OPS.store_kv_int8(x, x, buf[0], buf[1], loc + 80)
