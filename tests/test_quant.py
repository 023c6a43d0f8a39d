"""Weight-only int8/int4 linears against float32 matmul, and the CPU-aware choice of dtype/quantization (issue 14)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import radixserve_kernels.cpu as cpu_kernels
from radixserve.model import quant
from radixserve.model import cpu_select
from radixserve.model.llama import Linear
from radixserve.model.quant import (
    INT4_REL_TOL,
    INT8_ACT_TOL,
    INT8_REL_TOL,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    int4_group_for,
    quantize_int4,
    quantize_int8,
)

SHAPES = [
    (1, 64, 96),
    (2, 200, 40),
    (3, 896, 128),
    (17, 128, 4864),
    (96, 256, 33),
]  # (rows, in, out): odd widths (padded to the kernel's 8 x 64 blocks); the kernel's 1-2-row and 3+-row paths, dense


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_float32_matmul(shape, act):
    torch.manual_seed(sum(shape))
    m, k, n = shape
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    lin = Int8Linear.from_float(w, b)
    y = lin(x.to(act))
    assert y.shape == (m, n) and y.dtype == act
    assert rel_err(y, x @ w.T + b) <= INT8_REL_TOL
    # Against its own dequantized weight: only the activations' rounding (INT8_ACT_TOL).
    assert rel_err(y, x @ dequantize_int8(*lin.int8_weight()).T + b) <= INT8_ACT_TOL


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_float32_matmul(shape, group, act):
    torch.manual_seed(sum(shape) + group)
    m, k, n = shape
    if k % group:
        pytest.skip(f"group {group} does not divide K={k} (the model falls back to a smaller group)")
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    q, scale, zero = quantize_int4(w, group)
    lin = Int4Linear(q, scale, zero, b)
    y = lin(x.to(act))
    assert y.shape == (m, n) and y.dtype == act
    assert rel_err(y, x @ w.T + b) <= INT4_REL_TOL[group]
    # Against its own dequantized weight the op differs only by bf16 rounding (x, scale/zero, y).
    assert rel_err(y, x @ dequantize_int4(q, scale, zero).T + b) <= 0.01


def test_int4_quantize_round_trip_and_constant_groups():
    w = torch.randn(16, 128)
    w[2] = 0.5  # constant row: every group has scale 1 and reproduces 0.5 exactly
    q, scale, zero = quantize_int4(w, 32)
    assert q.dtype == torch.int32 and q.min() >= 0 and q.max() <= 15 and scale.shape == (16, 4)
    err = (dequantize_int4(q, scale, zero) - w).abs()
    assert torch.all(err <= scale.repeat_interleave(32, dim=1) / 2 + 1e-6)  # at most half a step per group
    assert torch.all(err[2] < 1e-6)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(torch.randn(16, 48), 32)


def test_int4_group_fallback():
    assert int4_group_for(896, 128) == 128 and int4_group_for(96, 128) == 32 and int4_group_for(64, 128) == 64
    assert int4_group_for(33, 64) is None


def test_int8_quantize_round_trip_and_zero_rows():
    w = torch.randn(8, 32)
    w[3] = 0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (8,) and q.abs().max() <= 127
    assert torch.all(q[3] == 0)
    err = (dequantize_int8(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-6)  # at most half a quantization step per row


@pytest.mark.parametrize(
    ("fmt", "cls", "tol"), [("int8", Int8Linear, INT8_REL_TOL), ("int4", Int4Linear, INT4_REL_TOL[64])]
)
def test_load_model_quantized_replaces_every_linear_and_the_tied_head(tmp_path, fmt, cls, tol):
    from radixserve.model.loader import load_model
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # tied embeddings
    cfg, ref = load_model(path, torch.float32)
    _, model = load_model(path, torch.float32, quantization=fmt)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, cls) for m in model.modules()) == 4 * cfg.num_layers + 1
    hidden = torch.randn(5, cfg.hidden_size)
    before, after = ref.compute_logits(hidden), model.compute_logits(hidden)
    assert rel_err(after, before) <= tol


def _pretend(monkeypatch, cap: str, bf16_hw: bool, amx: bool) -> None:
    monkeypatch.setattr(cpu_select, "cpu_capability", lambda: cap)
    monkeypatch.setattr(cpu_select, "has_bf16_hardware", lambda: bf16_hw)
    monkeypatch.setattr(cpu_select, "has_amx", lambda: amx)


@pytest.mark.parametrize(
    ("cap", "bf16_hw", "amx", "kind", "expected"),
    [
        # the EPYC: bf16 emulated, 5x slower prefill; bf16 KV pages, which no matmul reads
        ("AVX2", False, False, "AVX2", ("float32", "int8", "bfloat16")),
        ("AVX512", False, False, "AVX512", ("float32", "int8", "bfloat16")),  # AVX-512 without BF16
        ("AVX512", True, False, "AVX512_BF16", ("bfloat16", "int8", "bfloat16")),  # int8 halves decode bytes
        ("AVX512", True, True, "AMX", ("bfloat16", "int8", "bfloat16")),  # int4 fails the quality bar
        ("DEFAULT", False, False, "DEFAULT", ("float32", "none", "bfloat16")),
    ],
)
def test_auto_choice_per_cpu_kind(monkeypatch, cap, bf16_hw, amx, kind, expected):
    _pretend(monkeypatch, cap, bf16_hw, amx)
    assert cpu_select.cpu_kind() == kind
    c = cpu_select.choose("auto", "auto")
    assert (c.dtype, c.quantization, c.kv_pages("auto")) == expected
    assert c.reason.startswith(f"cpu={kind}; ") and all(why in c.reason for why in cpu_select.CHOICES[kind][2:])
    assert c.kv_pages("float32") == "float32" and c.kv_pages("int8") == "int8"  # an explicit KV dtype is kept
    # An explicit dtype is that dtype's numerics, its KV pages included (the float32 parity tests rely on it).
    assert cpu_select.choose("float32", "auto").kv_pages("auto") == "float32"


def test_explicit_choices_are_kept_and_bad_ones_refused(monkeypatch):
    _pretend(monkeypatch, "AVX2", False, False)
    assert cpu_select.choose("bfloat16", "int8").quantization == "int8"
    c = cpu_select.choose("float32", "int4")
    assert (c.dtype, c.quantization) == ("float32", "int4") and "explicit dtype=float32, quantization=int4" in c.reason
    assert cpu_select.choose("float32", "auto").quantization == "none"
    _pretend(monkeypatch, "AVX512", True, True)  # AMX: auto alone picks int8, an explicit dtype keeps dense weights
    assert cpu_select.choose("auto", "auto").quantization == "int8"
    for dtype in ("float32", "bfloat16"):
        c = cpu_select.choose(dtype, "auto")
        assert (c.dtype, c.quantization) == (dtype, "none") and "no weight quantization unless asked" in c.reason
    with pytest.raises(ValueError, match="quantization must be"):
        cpu_select.choose("auto", "int3")
    with pytest.raises(ValueError, match="CPU path"):
        cpu_select.choose("auto", "int4", "cuda")
    assert cpu_select.choose("auto", "auto", "cuda").dtype == "bfloat16"


def test_engine_reports_the_choice(monkeypatch, tiny_model_dir):
    from radixserve import Engine

    _pretend(monkeypatch, "AVX512", True, True)
    with Engine(model=tiny_model_dir, max_total_tokens=256) as eng:
        info, stats = eng.model_info(), eng.cache_stats()
        assert (info["dtype"], info["quantization"]) == ("bfloat16", "int8")
        assert (
            info["quantization_reason"].startswith("cpu=AMX")
            and stats["quantization_reason"] == info["quantization_reason"]
        )
        out = eng.generate(input_ids=list(range(40)), sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4  # a 40-token prefill (dense int8 path) and decode steps (int8 op)


def test_float32_activations_store_bfloat16_kv_pages(monkeypatch, tiny_model_dir):
    """Where auto picks float32 activations (no bf16 hardware), the KV pages are bfloat16, and the decode steps
    still store them with the C++ op: the same greedy tokens as an engine told kv_cache_dtype="bfloat16" with the
    torch store (the index_copy_ of rows rounded by torch)."""
    from radixserve import Engine
    from radixserve.cache.kv_pool import KVPool

    _pretend(monkeypatch, "AVX2", False, False)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(model=tiny_model_dir, max_total_tokens=256) as eng:
        assert (eng.model_info()["dtype"], eng.model_info()["kv_cache_dtype"]) == ("float32", "bfloat16")
        assert "bfloat16 KV pages" in eng.model_info()["quantization_reason"]
        if eng.runner.pool._store_rows is not None:
            assert eng.runner.pool.store_op(torch.float32) == "rows"
        ours = eng.generate(input_ids=list(range(40)), sampling_params=params)["output_ids"]
    monkeypatch.setattr(KVPool, "store_op", lambda self, dtype: None)  # every store through the format's torch
    with Engine(model=tiny_model_dir, max_total_tokens=256, kv_cache_dtype="bfloat16") as eng:
        assert eng.runner.pool.format.name == "bfloat16"
        assert eng.generate(input_ids=list(range(40)), sampling_params=params)["output_ids"] == ours


@pytest.mark.parametrize("rows", [1, 2, 5, 47, 60])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_paths_share_the_weights(monkeypatch, rows, act):
    """The kernel (rows < INT8_KERNEL_ROWS), the widened dense matmul and the pure-torch path (no compiled kernels)
    compute with the same weights: they differ by the activations' rounding only."""
    torch.manual_seed(rows)
    w, b, x = torch.randn(72, 130), torch.randn(72), torch.randn(rows, 130).to(act)
    lin = Int8Linear.from_float(w, b)
    ref = x.float() @ dequantize_int8(*lin.int8_weight()).T + b
    ys = {"default": lin(x)}
    monkeypatch.setattr(quant, "INT8_KERNEL_ROWS", 0)
    ys["dense"] = lin(x)
    monkeypatch.setattr(quant.cpu_kernels, "ops", lambda: None)
    ys["torch"] = lin(x)
    for path, y in ys.items():
        assert y.dtype == act and rel_err(y, ref) <= INT8_ACT_TOL, path


def test_int8_pack_round_trip():
    q = torch.randint(-127, 128, (21, 70), dtype=torch.int8)
    lin = Int8Linear(q, torch.rand(21), None)
    assert lin.codes.shape == (3, 2, 8, 64) and lin.codes.dtype == torch.uint8  # padded to 24 x 128
    assert torch.equal(lin.int8_weight()[0], q)
    assert torch.equal(quant.unpack_int8(lin.codes, torch.float32)[:21, :70], q.float())
    for dtype in (torch.float32, torch.bfloat16):  # a step whose rows all skip the LM head
        assert lin(torch.empty(0, 70, dtype=dtype)).shape == (0, 21)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_int8_kernel_paths_for_other_cpus(tmp_path, march):
    """The kernel's AVX2 (haswell) and plain C++ (x86-64) builds, compiled here and run in a fresh process (one
    library per process registers the ops), against the float32 matmul and batch-invariant in deterministic mode;
    this CPU runs the AVX-512 path in-process."""
    if cpu_kernels.ops() is None:
        pytest.skip("no C++ toolchain: the CPU kernels cannot be built")
    code = (
        "import torch\n"
        "from radixserve.model.quant import Int8Linear, dequantize_int8\n"
        "import radixserve_kernels.cpu as k\n"
        "assert k.ops() is not None\n"
        "torch.manual_seed(0)\n"
        "for rows in (1, 2, 5):\n"
        "    w, x = torch.randn(40, 200), torch.randn(rows, 200)\n"
        "    lin = Int8Linear.from_float(w, None)\n"
        "    ref = x @ dequantize_int8(*lin.int8_weight()).T\n"
        "    err = ((lin(x) - ref).norm() / ref.norm()).item()\n"
        "    assert err < 1e-5, (rows, err)\n"
        "lin.batch_invariant = True\n"  # deterministic mode: a row's output whatever the step's row count
        "x = torch.randn(60, 200).bfloat16()\n"
        "full = lin(x)\n"
        "assert all(torch.equal(lin(x[:m]), full[:m]) for m in (1, 2, 3, 48)), 'not batch-invariant'\n"
    )
    env = {**os.environ, "RADIXSERVE_CPU_MARCH": march}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_int8_kernel_on_large_matrices_from_several_threads():
    """Matrices past 2 MB of codes split their rows between the kernel's spin pool (radixserve_kernels/cpu/spin_pool.h)
    and the caller; two callers at once take turns. Every result must equal the single-threaded one."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(3)
    lin = Int8Linear.from_float(torch.randn(2056, 1088), torch.randn(2056))  # 2.2 MB of codes, odd widths
    xs = [torch.randn(rows, 1088) for rows in (1, 2, 5, 1, 2, 5)]
    refs = [x @ dequantize_int8(*lin.int8_weight()).T + lin.bias for x in xs]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            for y, ref in zip(pool.map(lin, xs), refs):
                assert rel_err(y, ref) <= INT8_ACT_TOL


@pytest.mark.parametrize("gguf_auto", ["int8", "gguf"])
def test_auto_on_a_gguf_model_is_gguf_auto(monkeypatch, gguf_auto):
    """ "auto" on a GGUF model means cpu_select.GGUF_AUTO where the table asks for int8; a Hugging Face checkpoint
    keeps int8; an explicit dtype or format, and a kind whose table runs dense weights, are unchanged."""
    _pretend(monkeypatch, "AVX512", True, False)
    monkeypatch.setattr(cpu_select, "GGUF_AUTO", gguf_auto)
    c = cpu_select.choose("auto", "auto", gguf_model=True)
    assert (c.dtype, c.quantization) == ("bfloat16", gguf_auto) and "a GGUF model" in c.reason
    assert "int8 weights read by" not in c.reason  # the table's weights are replaced, and so is their reason
    assert cpu_select.choose("auto", "auto").quantization == "int8"
    assert "int8 weights read by" in cpu_select.choose("auto", "auto").reason
    assert cpu_select.choose("bfloat16", "auto", gguf_model=True).quantization == "none"
    assert cpu_select.choose("auto", "int4", gguf_model=True).quantization == "int4"
    _pretend(monkeypatch, "DEFAULT", False, False)
    assert cpu_select.choose("auto", "auto", gguf_model=True).quantization == "none"
