"""Our GGUF block kernels (radixserve_kernels/cpu/gguf_linear.cpp, gguf_blocks.h) against gguf-py's dequantizers and a
plain PyTorch dequantize-then-matmul, on random blocks of every format we read (issue 38)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

import radixserve_kernels.cpu as cpu_kernels
from other_builds import failure_on_build, has_simde

T = GGMLQuantizationType
FORMATS = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each format's fp16 scales inside a block (ggml-common.h): random bytes there would be NaN/inf.
FP16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# Byte offsets of the K-quants' sub-block scales (and Q4_K's and Q5_K's minima) inside a block.
SCALE_BYTES = {T.Q4_K: range(4, 16), T.Q5_K: range(4, 16), T.Q6_K: range(192, 208)}
# (rows M, out N, in K): 1-2 rows (decode), a few past the kernel's 4-row register block, 8 (eight weight rows a
# pass), K = 896 and 4864 as in the default model (K = 896 is not a multiple of 256: K-quant shapes use 1024 and 4864).
SHAPES = [
    (1, 40, 256),
    (2, 33, 1024),
    (7, 17, 4864),
    (5, 24, 896),
    (8, 37, 1024),
    (6, 21, 320),
    (40, 24, 896),
    (40, 24, 1024),
]

# The kernel against the float64 product of the same rounded activations and the same weights: it sums float32
# terms a * x_scale * (integer dot of 16 or 32 columns) and subtracts the offsets b * x_scale * sum(codes) separately, so its
# only error is float32 rounding of those partial sums, bounded relative to the sum of their magnitudes. 2^-20 of
# |x| @ (|a u| + |b|) leaves room for the ~K/16 roundings of a row (measured below 2^-27 on every format). The AVX2
# build's K-quants sum a whole super-block in integers, eight lanes, and round each once (float(lane) * (d * x_scale)).
SUM_ORDER_TOL = 2.0**-20


def random_blocks(fmt: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """`[n, bytes]` uint8 of random codes and scales, the fp16 fields set to small finite values."""
    weights, size = GGML_QUANT_SIZES[fmt]
    if k % weights:
        pytest.skip(f"{fmt.name} blocks hold {weights} weights; K={k} is not a multiple")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // weights, size), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt]:
        d = (rng.standard_normal((n, k // weights)) * 0.02).astype(np.float16)
        raw[..., offset : offset + 2] = d.view(np.uint8).reshape(n, k // weights, 2)
    return raw.reshape(n, -1)


def reference_weights(blocks: np.ndarray, fmt: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.asarray(quants.dequantize(blocks, fmt), dtype=np.float32))


def quantize_like_q8_0(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's q8_0 rounding in PyTorch: per block of 32, scale absmax / 127, codes round-half-even(x * 127 / absmax);
    with block 256 the same per K-quant super-block (what the AVX2 build's Q4_K and Q6_K read, like ggml's q8_K)."""
    b = x.float().reshape(x.shape[0], -1, block)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(b * inv[..., None]), -127, 127).to(torch.int8)
    return q.reshape(x.shape), amax / 127.0


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.ops()
    if ops is None:
        pytest.skip("no C++ toolchain: the CPU kernels cannot be built")
    return ops


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_equals_gguf_py(ops, fmt):
    blocks = random_blocks(fmt, 9, 512, seed=int(fmt))
    ours = ops.gguf_dequantize(torch.from_numpy(blocks), int(fmt), None)
    assert torch.equal(ours, reference_weights(blocks, fmt))  # bit for bit: a * u - b rounds once, as ggml does
    ids = torch.tensor([4, 0, 4, 8])
    assert torch.equal(ops.gguf_dequantize(torch.from_numpy(blocks), int(fmt), ids), ours[ids])


@pytest.mark.parametrize("block", [32, 256])
def test_activation_rounding_matches_q8_0(ops, block):
    torch.manual_seed(0)
    x = torch.randn(5, 1024) * torch.rand(5, 1024) * 3
    x[1, :256] = 0  # an all-zero block: scale 0, codes 0
    q, s = ops.gguf_quantize_activations(x, block)
    rq, rs = quantize_like_q8_0(x, block)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_equals_dequantize_then_matmul(ops, fmt, shape):
    m, n, k = shape
    blocks = random_blocks(fmt, n, k, seed=m * n + k)
    w = reference_weights(blocks, fmt)
    torch.manual_seed(k + n)
    x, bias = torch.randn(m, k), torch.randn(n)
    y = ops.gguf_linear(x, [torch.from_numpy(blocks)], [int(fmt)], bias)
    block = ops.gguf_activation_block(int(fmt))  # 256: this build's K-quants read x rounded per super-block
    q, s = quantize_like_q8_0(x, block)
    xq = (q.double().reshape(m, -1, block) * s.double()[..., None]).reshape(m, k)
    ref = xq @ w.double().T + bias.double()
    coded = (w.double() - torch.from_numpy(lowest_weights(blocks, fmt, ops))).abs()  # |a u|; |b| <= |w| + |a u|
    bound = SUM_ORDER_TOL * (xq.abs() @ (w.double().abs() + 2 * coded).T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all(), ((y.double() - ref).abs() / bound).max()
    # Against the float activations: the rounding of x is the only difference (d/sqrt(12) per value).
    exact = x.double() @ w.double().T + bias.double()
    assert ((y.double() - exact).norm() / (exact - bias.double()).norm()).item() < 0.02


def lowest_weights(blocks: np.ndarray, fmt: GGMLQuantizationType, ops) -> np.ndarray:
    """The weights with every code set to its lowest value: a * 0 - b = -b, the offsets the kernel subtracts."""
    zeroed = blocks.copy()
    weights, size = GGML_QUANT_SIZES[fmt]
    view = zeroed.reshape(blocks.shape[0], -1, size)
    fp16 = {o for f in FP16_FIELDS[fmt] for o in (f, f + 1)}
    keep = set(SCALE_BYTES.get(fmt, ()))
    for byte in range(size):
        if byte not in fp16 and byte not in keep:
            view[..., byte] = 0x80 if fmt == T.Q8_0 else 0  # Q8_0 stores q: code u = q + 128 is 0 at q = -128
    return np.asarray(ops.gguf_dequantize(torch.from_numpy(zeroed), int(fmt), None).double())


def test_fused_parts_of_several_types_and_batch_invariance(ops):
    """q/k/v of a layer may each have their own type; a row's result never depends on the rows beside it."""
    k = 1024
    # 43, 11, 6, 13: tiles with rows left over (the eight-row groups of Q4_0, Q5_0 and Q8_0 then run short ones)
    parts = [(T.Q5_0, 43), (T.Q4_0, 11), (T.Q8_0, 6), (T.Q4_K, 24), (T.Q5_K, 19), (T.Q6_K, 13)]
    blocks = [torch.from_numpy(random_blocks(f, n, k, seed=i)) for i, (f, n) in enumerate(parts)]
    types = [int(f) for f, _ in parts]
    torch.manual_seed(1)
    x = torch.randn(11, k)
    y = ops.gguf_linear(x, blocks, types, None)
    singles = torch.cat([ops.gguf_linear(x, [b], [t], None) for b, t in zip(blocks, types)], dim=1)
    assert torch.equal(y, singles)
    # 6-8 rows take eight weight rows a pass (all but Q8_0), 1-5 four (gguf_tiles.h, fused_rows)
    for rows in (range(1), range(1, 3), range(7, 10), range(2, 6), range(3, 11), range(4, 9), range(6), range(2, 9)):
        assert torch.equal(ops.gguf_linear(x[list(rows)], blocks, types, None), y[list(rows)])
    # 44 rows: the activations are rounded on the pool's threads (from 32 rows), the same values per row.
    assert torch.equal(ops.gguf_linear(x.repeat(4, 1), blocks, types, None), y.repeat(4, 1))
    bf = ops.gguf_linear(x.bfloat16(), blocks, types, None)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, ops.gguf_linear(x.bfloat16().float(), blocks, types, None).bfloat16())


def test_32_weight_formats_end_on_half_a_step(ops):
    """K = 320: the VNNI decode rows of Q4_0, Q5_0 and Q8_0 take 128 columns a step, the last step here two blocks;
    every row count gives the tiles' values (44 rows)."""
    k = 320
    parts = [(T.Q5_0, 13), (T.Q4_0, 9), (T.Q8_0, 6)]
    blocks = [torch.from_numpy(random_blocks(f, n, k, seed=i)) for i, (f, n) in enumerate(parts)]
    types = [int(f) for f, _ in parts]
    torch.manual_seed(3)
    x = torch.randn(11, k)
    tiles = ops.gguf_linear(x.repeat(4, 1), blocks, types, None)[:11]
    for rows in (range(1), range(3), range(8), range(11)):
        assert torch.equal(ops.gguf_linear(x[list(rows)], blocks, types, None), tiles[list(rows)])


def test_large_matrix_split_between_threads_equals_one_thread(ops):
    """Past 1 MiB of blocks the tiles are shared with the spin pool's threads: the same values as in one call."""
    blocks = torch.from_numpy(random_blocks(T.Q5_0, 2000, 896, seed=7))  # 1.2 MiB
    torch.manual_seed(2)
    x = torch.randn(3, 896)
    y = ops.gguf_linear(x, [blocks], [int(T.Q5_0)], None)
    halves = torch.cat(
        [
            ops.gguf_linear(x, [blocks[:1000]], [int(T.Q5_0)], None),
            ops.gguf_linear(x, [blocks[1000:]], [int(T.Q5_0)], None),
        ],
        dim=1,
    )
    assert torch.equal(y, halves)


@pytest.mark.parametrize("march", ["haswell", "x86-64", "skylake-avx512", "vnni-emulated"])
def test_other_instruction_sets(ops, march):
    """The AVX2 (haswell) and plain C++ (x86-64) builds, AVX-512 without VNNI (skylake-avx512: its decode takes the
    AVX2 path, its activations AVX-512 code), and the AVX-512 VNNI path on a CPU without it (vnni-emulated: a haswell
    build whose GGUF kernels take their AVX-512 intrinsics from SIMDe), compiled here and run in a fresh process (one
    library per process registers the ops), through the same checks; this CPU runs its own path in-process."""
    have = set(cpu_kernels.cpu_flags().split())
    if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
        pytest.skip("this CPU cannot run an AVX-512 build")
    if march == "vnni-emulated" and {"avx512f", "avx512bw", "avx512_vnni"} <= have:
        pytest.skip("this CPU runs the VNNI path itself (the in-process tests)")
    if march == "vnni-emulated" and not has_simde():
        pytest.skip(
            "SIMDe's headers are not installed (Debian: libsimde-dev; scripts/bootstrap.sh installs it as root)"
        )
    tests = "test_dequantize_equals_gguf_py or test_linear_equals or test_fused_parts or test_activation_rounding"
    emulated = march == "vnni-emulated"
    failure = failure_on_build("haswell" if emulated else march, [__file__], tests, emulate_vnni=emulated)
    assert failure is None, failure
