"""Triton kernels (radixserve_kernels/) against a float64 PyTorch reference: on a GPU when there is one, else on the CPU
through the Triton interpreter.

Inputs are fresh random values each run (the seed is in every failure message); outputs and the split-KV
workspace are poisoned with NaN first, so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

# Without a GPU, conftest.py has set TRITON_INTERPRET=1 before any kernel is imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")
# The interpreter itself trips this numpy deprecation when it turns a scalar tensor into a loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from radixserve_kernels.decode_attention import decode_attention, decode_num_splits, decode_workspace  # noqa: E402
from radixserve_kernels.extend_attention import extend_attention  # noqa: E402
from radixserve_kernels.kv_store import store_kv  # noqa: E402

NUM_KV_HEADS = 2


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


# Outputs are compared elementwise as |out - ref| <= atol + rtol * |ref|. float32 is exact up to summation order;
# float16 and bfloat16 round the output once (and on a GPU also the softmax weights fed to the P @ V product).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (dtype, page_size, gqa_ratio, head_dim): every pair of values of any two of these columns occurs in some row.
PAIRWISE = [
    (torch.float32, 1, 1, 64),
    (torch.float32, 16, 4, 128),
    (torch.float32, 16, 7, 64),
    (torch.float16, 1, 4, 64),
    (torch.float16, 16, 7, 128),
    (torch.float16, 16, 1, 64),
    (torch.bfloat16, 16, 1, 128),
    (torch.bfloat16, 1, 7, 128),
    (torch.bfloat16, 16, 4, 64),
]
CASE_IDS = [f"{str(d).split('.')[-1]}-ps{p}-gqa{g}-d{h}" for d, p, g, h in PAIRWISE]


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(2**31)


def random_pool(
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pages, random everywhere so a read of a wrong slot changes the result."""
    shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def random_page_table(seq_lens: list[int], page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct pages (never the sink page 0) in shuffled order; unused entries point at page 0."""
    need = [math.ceil(s / page_size) for s in seq_lens]
    pages = (torch.randperm(num_pages - 1, generator=gen)[: sum(need)] + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(pages[:n], dtype=torch.int32)
        del pages[:n]
    return table


def gather_tokens(buf: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens 0..n-1 of one request, `[n, kv_heads, D]`, read from its page-table row."""
    page_size = buf.shape[1]
    slots = (pages.long()[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
    return buf.flatten(0, 1)[slots]


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """float64 causal attention of q `[n, H, D]` at positions prefix_len.. over keys/values `[prefix_len + n, KV, D]`."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    logits = torch.einsum("ihd,nhd->hin", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= prefix_len + torch.arange(q.shape[0])[:, None]
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hin,nhd->ihd", weights, v)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int, what: str) -> None:
    tol = TOLERANCE[dtype]
    err = (out.double() - ref).abs()
    bad = ~(err <= tol + tol * ref.abs())  # NaN (an unwritten element) counts as bad
    assert not bad.any(), f"{what}: {int(bad.sum())} bad elements, max error {err.max().item():.3g} (seed={seed})"


def extend_lengths(page_size: int) -> list[tuple[int, int]]:
    """(prefix, extend) per request: no prefix; a single new token after a mid-page prefix; a chunk spanning two
    query blocks whose sequence ends mid-page."""
    return [(0, 5), (19, 1), (2 * page_size if page_size > 1 else 7, 37)]


@pytest.mark.parametrize("dtype,page_size,group,head_dim", PAIRWISE, ids=CASE_IDS)
def test_extend_attention(dtype: torch.dtype, page_size: int, group: int, head_dim: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lens = extend_lengths(page_size)
    prefix = [p for p, _ in lens]
    extend = [e for _, e in lens]
    num_pages = 2 + sum(math.ceil((p + e) / page_size) for p, e in lens)
    k_buf, v_buf = random_pool(num_pages, page_size, head_dim, dtype, gen)
    table = random_page_table([p + e for p, e in lens], page_size, num_pages, gen)
    tokens, heads = sum(extend), NUM_KV_HEADS * group
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5

    # The pool slots of the new tokens still hold random values: the kernel must take new K/V from k and v.
    args = on_device(q, k, v, out, k_buf, v_buf, table, indptr, torch.tensor(prefix, dtype=torch.int32))
    out = extend_attention(*args, max(extend), scale).cpu()

    for i, (p, e) in enumerate(lens):
        rows = slice(int(indptr[i]), int(indptr[i + 1]))
        keys = torch.cat([gather_tokens(k_buf, table[i], p), k[rows]])
        values = torch.cat([gather_tokens(v_buf, table[i], p), v[rows]])
        ref = reference_attention(q[rows], keys, values, p, scale)
        assert_close(out[rows], ref, dtype, seed, f"request {i} (prefix {p}, extend {e})")


@pytest.mark.parametrize("dtype,page_size,group,head_dim", PAIRWISE, ids=CASE_IDS)
def test_decode_attention(dtype: torch.dtype, page_size: int, group: int, head_dim: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Length 1, one past a full page, mid-page, exactly two pages.
    seq_lens = [1, 17, 40, 32]
    num_pages = 2 + sum(math.ceil(s / page_size) for s in seq_lens)
    k_buf, v_buf = random_pool(num_pages, page_size, head_dim, dtype, gen)
    table = random_page_table(seq_lens, page_size, num_pages, gen)
    heads = NUM_KV_HEADS * group
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    # 3 splits of 16-token blocks: the 40-token request merges three partial results, the 17-token one two
    # and an empty split, the 1-token one a single split and two empty ones.
    splits = 3
    workspace = decode_workspace(len(seq_lens), heads, head_dim, splits, DEVICE)
    for w in workspace:
        w.fill_(float("nan"))
    scale = head_dim**-0.5

    args = on_device(q, k_buf, v_buf, table, torch.tensor(seq_lens, dtype=torch.int32), out)
    out = decode_attention(*args, scale, num_splits=splits, workspace=workspace, block_n=16).cpu()

    for i, s in enumerate(seq_lens):
        ref = reference_attention(
            q[i : i + 1], gather_tokens(k_buf, table[i], s), gather_tokens(v_buf, table[i], s), s - 1, scale
        )
        assert_close(out[i : i + 1], ref, dtype, seed, f"request {i} (seq_len {s})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_its_slots(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_buf, v_buf = random_pool(6, 16, 64, dtype, gen)
    before_k, before_v = k_buf.clone(), v_buf.clone()
    loc = torch.randperm(6 * 16, generator=gen)[:11]
    k = torch.randn(11, NUM_KV_HEADS, 64, generator=gen).to(dtype)
    v = torch.randn(11, NUM_KV_HEADS, 64, generator=gen).to(dtype)

    k_dev, v_dev = on_device(k_buf, v_buf)
    store_kv(k_dev, v_dev, *on_device(loc, k, v))
    k_buf, v_buf = k_dev.cpu(), v_dev.cpu()

    expect_k, expect_v = before_k.flatten(0, 1), before_v.flatten(0, 1)
    expect_k[loc], expect_v[loc] = k, v
    assert torch.equal(k_buf.flatten(0, 1), expect_k), f"seed={seed}"
    assert torch.equal(v_buf.flatten(0, 1), expect_v), f"seed={seed}"


def test_store_kv_casts_to_pool_dtype(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_buf, v_buf = random_pool(3, 4, 16, torch.float16, gen)
    loc = torch.tensor([5, 0, 11])
    k = torch.randn(3, NUM_KV_HEADS, 16, generator=gen)
    v = torch.randn(3, NUM_KV_HEADS, 16, generator=gen)
    k_dev, v_dev = on_device(k_buf, v_buf)
    store_kv(k_dev, v_dev, *on_device(loc, k, v))
    k_buf, v_buf = k_dev.cpu(), v_dev.cpu()
    assert torch.equal(k_buf.flatten(0, 1)[loc], k.half()) and torch.equal(v_buf.flatten(0, 1)[loc], v.half())


def test_decode_num_splits() -> None:
    # A large batch already fills the GPU: one split.
    assert decode_num_splits(batch_size=64, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1
    # One long request: as many splits as allowed.
    assert decode_num_splits(batch_size=1, num_kv_heads=2, max_seq_len=8192, num_sms=132) == 16
    # A short sequence is not cut below the minimum split length.
    assert decode_num_splits(batch_size=1, num_kv_heads=2, max_seq_len=300, num_sms=132) == 3
    assert decode_num_splits(batch_size=1, num_kv_heads=2, max_seq_len=1, num_sms=132) == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_ragged_batches_default_blocks(dtype: torch.dtype, seed: int) -> None:
    """Random lengths with the kernels' default block sizes (those a GPU launch uses)."""
    gen = torch.Generator().manual_seed(seed)
    page_size, group, head_dim = 16, 7, 64
    rnd = random.Random(seed)
    lens = [(rnd.choice([0, rnd.randrange(1, 150)]), rnd.randrange(1, 80)) for _ in range(4)]
    num_pages = 2 + sum(math.ceil((p + e) / page_size) for p, e in lens)
    k_buf, v_buf = random_pool(num_pages, page_size, head_dim, dtype, gen)
    table = random_page_table([p + e for p, e in lens], page_size, num_pages, gen)
    extend = [e for _, e in lens]
    tokens, heads, scale = sum(extend), NUM_KV_HEADS * group, head_dim**-0.5
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    args = on_device(q, k, v, out, k_buf, v_buf, table, indptr, torch.tensor([p for p, _ in lens], dtype=torch.int32))
    out = extend_attention(*args, max(extend), scale).cpu()
    for i, (p, e) in enumerate(lens):
        rows = slice(int(indptr[i]), int(indptr[i + 1]))
        ref = reference_attention(
            q[rows],
            torch.cat([gather_tokens(k_buf, table[i], p), k[rows]]),
            torch.cat([gather_tokens(v_buf, table[i], p), v[rows]]),
            p,
            scale,
        )
        assert_close(out[rows], ref, dtype, seed, f"extend request {i} (prefix {p}, extend {e})")

    seq_lens = [p + e for p, e in lens]
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    splits = rnd.randrange(1, 5)
    args = on_device(q, k_buf, v_buf, table, torch.tensor(seq_lens, dtype=torch.int32), out)
    out = decode_attention(*args, scale, num_splits=splits).cpu()
    for i, s in enumerate(seq_lens):
        ref = reference_attention(
            q[i : i + 1], gather_tokens(k_buf, table[i], s), gather_tokens(v_buf, table[i], s), s - 1, scale
        )
        assert_close(out[i : i + 1], ref, dtype, seed, f"decode request {i} (seq_len {s}, {splits} splits)")


def compile_for_gpu(arch: int) -> list[str]:
    """Compile every kernel to a cubin for CUDA `arch` (no GPU needed), with the warps the launchers choose;
    returns one `name:dtype:dim:registers:stack_bytes` per kernel (registers and stack read by cuobjdump).

    The interpreter checks no GPU limits (tl.dot shapes, shared memory, types, registers), the real compiler does.
    """
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve_kernels.common import attention_num_warps, decode_block_n, extend_blocks, is_interpreted
    from radixserve_kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel
    from radixserve_kernels.extend_attention import _extend_kernel
    from radixserve_kernels.kv_store import _store_kv_kernel
    from radixserve.cache.kv_format import scale_group

    assert not is_interpreted(_extend_kernel), "run with TRITON_INTERPRET unset"
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def build(fn: object, pointers: dict[str, str], consts: dict[str, object], dt: str, warps: int = 4) -> str:
        sig = {
            n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "sm_scale_log2" else "i32")
            for n in fn.arg_names
        }
        kernel = triton.compile(
            ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True)
        reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout).groups()
        return f"{fn.__name__}:{dt}:{consts.get('HEAD_DIM')}:{reg}:{stack}"

    built = []
    for dt, group, dim in (("bf16", 7, 128), ("bf16", 4, 128), ("fp16", 4, 128), ("fp32", 4, 64), ("fp32", 4, 128)):
        prec = "ieee" if dt == "fp32" else "tf32"
        warps = attention_num_warps(dim, torch_dtype[dt])
        rows, keys = extend_blocks(dim, torch_dtype[dt])
        block_g = 1 << (group - 1).bit_length()
        data = {n: f"*{dt}" for n in ("Q", "K", "V", "Out", "K_buf", "V_buf")}
        index = {"PageTable": "*i32", "QoIndptr": "*i32", "PrefixLens": "*i32", "SeqLens": "*i32"}
        partial = {"PartialOut": "*fp32", "PartialLse": "*fp32"}
        # int8 KV pages (K_/V_SCALE_GROUP: values then a float16 scale per group in each row, keys per 16, values
        # one a row) once, in the default model's shape.
        for scaled in (False, True) if (dt, group) == ("bf16", 4) else (False,):
            pages = data | ({"K_buf": "*i8", "V_buf": "*i8"} if scaled else {})
            for invariant in (False, True):  # the default kernel and deterministic mode's variant
                built.append(
                    build(
                        _extend_kernel,
                        pages | index,
                        dict(
                            PAGE_SIZE=16,
                            GROUP=group,
                            HEAD_DIM=dim,
                            BLOCK_G=block_g,
                            BLOCK_TOK=rows // block_g,
                            BLOCK_N=keys,
                            BLOCK_D=dim,
                            UPCAST=False,
                            DOT_PRECISION=prec,
                            K_SCALE_GROUP=scale_group(dim, "k") if scaled else 0,
                            V_SCALE_GROUP=scale_group(dim, "v") if scaled else 0,
                            BATCH_INVARIANT=invariant,
                        ),
                        dt,
                        warps,
                    )
                )
            for single in (True, False):
                built.append(
                    build(
                        _decode_split_kernel,
                        pages | index | partial,
                        dict(
                            PAGE_SIZE=16,
                            GROUP=group,
                            HEAD_DIM=dim,
                            BLOCK_H=16,
                            BLOCK_N=decode_block_n(dim, torch_dtype[dt], scaled),
                            BLOCK_D=dim,
                            SINGLE_SPLIT=single,
                            UPCAST=False,
                            DOT_PRECISION=prec,
                            K_SCALE_GROUP=scale_group(dim, "k") if scaled else 0,
                            V_SCALE_GROUP=scale_group(dim, "v") if scaled else 0,
                        ),
                        dt,
                        warps,
                    )
                )
        built.append(build(_decode_merge_kernel, data | partial, dict(HEAD_DIM=dim, BLOCK_S=16, BLOCK_D=dim), dt))
        built.append(build(_store_kv_kernel, data | {"Loc": "*i64"}, dict(ROW=2 * dim, BLOCK=2 * dim), dt))
    return built


@pytest.mark.slow
def test_kernels_compile_for_a_real_gpu() -> None:
    """Lower every kernel through ptxas for sm_90 in a fresh process, where the interpreter is off; none spills."""
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = "import test_kernels; print(*test_kernels.compile_for_gpu(90))"
    # keep any PYTHONPATH already set (the GPU machine's carried packages come through it)
    path = [tests_dir, os.path.dirname(tests_dir), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = [line.split(":") for line in done.stdout.split()]
    assert [k[0] for k in kernels].count("_decode_split_kernel") == 12, done.stdout  # 5 float configs and int8, x 2
    assert [k[0] for k in kernels].count("_extend_kernel") == 12, done.stdout  # the same, default and batch-invariant
    # With the launchers' warps no kernel spills registers to local memory on sm_90 (with 4 warps the bf16
    # head_dim-128 decode kernel used 255 registers and a 136-byte stack).
    spills = [k for k in kernels if int(k[4]) > 0]
    assert not spills, f"kernels with a stack frame (name, dtype, head_dim, registers, stack bytes): {spills}"
