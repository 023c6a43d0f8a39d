"""The GPU path on a machine without one: nothing imports flashinfer or touches CUDA unless asked, asking fails
clearly, and the CUDA-graph ladder's bucketing and padding (pure functions) are right."""

from __future__ import annotations

import importlib.abc
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.attention.flashinfer_backend import MIN_WORKSPACE_BYTES, prefill_wrapper_kwargs, workspace_bytes
from radixserve.attention.paged_metadata import build_paged_metadata
from radixserve.model.runner import default_attention_backend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cuda_graph import CudaGraphRunner, graph_batch_sizes, pad_decode_batch, padded_batch_size

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


class _BlockFlashInfer(importlib.abc.MetaPathFinder):
    """Any attempt to import flashinfer fails loudly (not with ImportError, which a caller might swallow)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "flashinfer":
            raise AssertionError(f"something imported {name}")
        return None


# ---- imports and construction without CUDA -------------------------------------------------------------------
@no_cuda
@pytest.mark.slow
def test_engine_on_cpu_never_imports_flashinfer_or_initializes_cuda(tiny_model_dir: Path) -> None:
    """A fresh interpreter imports radixserve and the GPU modules, builds an Engine and generates."""
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "flashinfer":
                    raise AssertionError("imported " + name)
        sys.meta_path.insert(0, Block())
        import torch, radixserve
        import radixserve.attention.flashinfer_backend, radixserve.attention.paged_metadata
        import radixserve.model.cuda_graph
        from radixserve import Engine
        with Engine(model={str(tiny_model_dir)!r}, dtype="float32", max_total_tokens=256) as eng:
            out = eng.generate(input_ids=[5, 6, 7], sampling_params={{"max_new_tokens": 2, "temperature": 0}})
        assert len(out["output_ids"]) == 2
        assert not torch.cuda.is_initialized(), "CUDA was initialized"
        try:
            import flashinfer
        except AssertionError:
            print("BLOCKER-WORKS")  # the guard above would have caught an import
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BLOCKER-WORKS" in proc.stdout


@no_cuda
def test_flashinfer_engine_on_cpu_is_a_clear_value_error(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve import Engine

    monkeypatch.setattr(sys, "meta_path", [_BlockFlashInfer(), *sys.meta_path])
    with pytest.raises(ValueError, match="flashinfer.*CUDA"):
        Engine(model=tiny_model_dir, dtype="float32", attention_backend="flashinfer", max_total_tokens=256)


@no_cuda
def test_flashinfer_backend_on_cpu_pool_is_a_clear_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.attention.flashinfer_backend import FlashInferAttentionBackend

    monkeypatch.setattr(sys, "meta_path", [_BlockFlashInfer(), *sys.meta_path])
    pool = KVPool(2, 4, 16, 2, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        FlashInferAttentionBackend(pool, 8, 64)


@no_cuda
def test_cuda_graph_runner_on_cpu_is_a_clear_value_error(tiny_model_dir: Path) -> None:
    from radixserve.attention.torch_backend import TorchAttentionBackend
    from radixserve.model.loader import load_model

    config, model = load_model(tiny_model_dir, torch.float32, "cpu")
    pool = KVPool(config.num_layers, 8, 16, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(model, TorchAttentionBackend(pool, config.num_heads, config.head_dim), 8, 256)


def test_flashinfer_plan_kwargs_bind_to_the_installed_wrappers() -> None:
    """Where flashinfer is installed (it imports without a GPU), our plan() keywords exist in its signatures."""
    flashinfer = pytest.importorskip("flashinfer")
    from radixserve.attention.flashinfer_backend import decode_plan_kwargs, prefill_plan_kwargs

    meta = build_paged_metadata(ForwardBatch.build([[1], [2, 3]], [3, 20], [[1], [2, 3]], 16, [0, 2]))
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=128, scale=0.1, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    # decode.plan forwards **kwargs to _plan_impl, whose signature names what plan accepts.
    inspect.signature(getattr(decode, "_plan_impl", decode.plan)).bind(None, **decode_plan_kwargs(meta, **shape))
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    inspect.signature(prefill.plan).bind(None, **prefill_plan_kwargs(meta, **shape))
    inspect.signature(prefill.__init__).bind(None, torch.empty(0), **prefill_wrapper_kwargs())


def test_prefill_wrapper_pins_fa2() -> None:
    """FA3 ('auto' on sm90 at head_dim 128) is slower for paged serving there and buggy on H100 PCIe."""
    assert prefill_wrapper_kwargs() == {"kv_layout": "NHD", "backend": "fa2"}


def test_flashinfer_workspace_grows_with_the_graph_batch() -> None:
    """128 MB ran out capturing ~410 decode requests of 32x128 heads; the workspace scales with the batch."""
    assert workspace_bytes(1, 32, 128) == MIN_WORKSPACE_BYTES
    assert workspace_bytes(410, 32, 128) > 128 << 20
    assert workspace_bytes(512, 32, 128) >= 2 * workspace_bytes(256, 32, 128) - 1


def test_default_attention_backend_by_device_and_dtype() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_attention_backend(cpu, torch.bfloat16) == "torch"
    assert default_attention_backend(cuda, torch.bfloat16) == "flashinfer"
    assert default_attention_backend(cuda, torch.float16) == "flashinfer"
    assert default_attention_backend(cuda, torch.float32) == "triton"  # flashinfer has no float32 kernels


@pytest.mark.parametrize("overlap", [False, True])
def test_every_engine_thread_binds_the_device(
    tiny_model_dir: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's current device is per thread: the loop thread and the overlap worker each bind the engine's."""
    import threading

    import radixserve.engine_loop as engine_module
    from radixserve import Engine

    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(engine_module, "bind_device", lambda d: bound.append((threading.current_thread().name, d)))
    with Engine(model=tiny_model_dir, dtype="float32", max_total_tokens=256, overlap_schedule=overlap) as eng:
        eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    names = {name.split("_")[0] for name, _ in bound}
    assert "radixserve-loop" in names
    assert ("radixserve-step" in names) == overlap
    assert all(d == torch.device("cpu") for _, d in bound)


# ---- the CUDA-graph ladder ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_bs", [1, 3, 8, 33, 64, 100, 256, 300])
def test_graph_batch_sizes_ladder(max_bs: int) -> None:
    sizes = graph_batch_sizes(max_bs)
    assert sizes[0] == 1 and sizes[-1] == max_bs
    assert sizes == sorted(set(sizes))
    assert all(b in sizes for b in (1, 2, 4, 8) if b <= max_bs)
    # Padding wastes less than a step of the ladder: doubling up to 8, then steps of 8, 16 past 64, 32 past 256.
    for lo, hi in zip(sizes, sizes[1:]):
        assert hi - lo <= (lo if lo < 8 else 8 if lo < 64 else 16 if lo < 256 else 32), (lo, hi)
    assert len(graph_batch_sizes(256)) <= 24


def test_padded_batch_size_picks_the_smallest_graph_that_fits() -> None:
    sizes = graph_batch_sizes(64)
    for bs in range(1, 65):
        size = padded_batch_size(bs, sizes)
        assert size is not None and size >= bs and size in sizes
        assert not [s for s in sizes if bs <= s < size]
    assert padded_batch_size(65, sizes) is None  # larger batches run eagerly
    assert [padded_batch_size(b, sizes) for b in (1, 3, 5, 9, 17, 57)] == [1, 4, 8, 16, 24, 64]


def decode_batch(page_size: int) -> ForwardBatch:
    """Three decode requests at 5, 17 and 33 tokens, the logits wanted for two of them."""
    tables = (
        [[3], [4, 9], [7, 2, 8]] if page_size == 16 else [list(range(10, 15)), list(range(20, 37)), list(range(40, 73))]
    )
    return ForwardBatch.build([[11], [12], [13]], [4, 16, 32], tables, page_size, [0, 2])


@pytest.mark.parametrize("page_size", [1, 16])
def test_pad_decode_batch_adds_sink_requests(page_size: int) -> None:
    batch = decode_batch(page_size)
    padded = pad_decode_batch(batch, 8)
    assert padded.batch_size == 8 and padded.is_decode
    assert padded.input_ids[:3].tolist() == [11, 12, 13] and padded.input_ids[3:].tolist() == [0] * 5
    assert padded.positions.tolist() == [4, 16, 32] + [0] * 5
    assert torch.equal(padded.out_cache_loc[:3], batch.out_cache_loc) and padded.out_cache_loc[3:].tolist() == [0] * 5
    assert padded.seq_lens.tolist() == [5, 17, 33] + [1] * 5
    assert padded.qo_indptr.tolist() == list(range(9))
    assert padded.logits_indices.tolist() == [0, 2]  # still the real rows
    meta, real = build_paged_metadata(padded), build_paged_metadata(batch)
    n = int(real.kv_indptr[-1])
    assert torch.equal(meta.kv_indices[:n], real.kv_indices)
    assert meta.kv_indices[n:].tolist() == [0] * 5  # each sink request reads one token of the sink page
    assert meta.kv_last_page_len.tolist() == real.kv_last_page_len.tolist() + [1] * 5
    assert pad_decode_batch(batch, 3).input_ids.tolist() == [11, 12, 13]


def test_pad_decode_batch_rejects_what_cannot_be_a_graph() -> None:
    with pytest.raises(ValueError, match="down to"):
        pad_decode_batch(decode_batch(16), 2)
    prefill = ForwardBatch.build([[1, 2, 3]], [0], [[5]], 16, [2])
    with pytest.raises(ValueError, match="pure-decode"):
        pad_decode_batch(prefill, 4)
    empty = pad_decode_batch(ForwardBatch.build([], [], [], 16, []), 4)  # what capture runs
    assert empty.batch_size == 4 and build_paged_metadata(empty).kv_indices.tolist() == [0] * 4


# ---- the GPU benchmarks' arithmetic (benchmarks/gpu/), checkable without a GPU -------------------------------------
def llama3_8b() -> Any:
    from benchmarks.gpu.common import LLAMA3_8B
    from radixserve.config import ModelConfig

    return ModelConfig.from_hf(LLAMA3_8B)


def test_roofline_counts_llama3_8b() -> None:
    from benchmarks.gpu.roofline import decode_step_bytes, kv_bytes_per_token, prefill_flops, total_params

    cfg = llama3_8b()
    assert total_params(cfg) == 8_030_261_248  # Meta-Llama-3-8B's published parameter count
    assert kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2) == 2 * 32 * 8 * 128 * 2
    embed = 128256 * 4096
    # Batch 1 over 2048 cached tokens: every weight but the embedding table, one embedding row, 2049 tokens of KV.
    assert decode_step_bytes(cfg, 1, 2048, 2) == (8_030_261_248 - embed) * 2 + 4096 * 2 + 2049 * 131072
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    # One token, no prefix: matmuls, attention over its one key, the LM head for one row.
    assert prefill_flops(cfg, 1) == 2 * per_layer * 32 + 4 * 128 * 32 * 32 + 2 * 4096 * 128256
    # The LM head runs for the logits rows only; causal attention covers the triangle of 8192 * 8193 / 2 keys.
    assert prefill_flops(cfg, 8192) - prefill_flops(cfg, 8192, logits_rows=0) == 2 * 4096 * 128256
    assert prefill_flops(cfg, 8192, logits_rows=0) == 2 * 8192 * per_layer * 32 + 4 * 128 * 32 * 32 * (8192 * 8193 / 2)
    # A cached prefix adds its keys to every new query.
    assert prefill_flops(cfg, 1, prefix_len=99) - prefill_flops(cfg, 1) == 4 * 128 * 32 * 32 * 99


def test_busy_fraction_merges_overlapping_gpu_intervals() -> None:
    from benchmarks.gpu.bench_engine import busy_fraction

    def ev(cat: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            ev("cpu_op", 0, 100),  # the window: 0..100 us
            ev("kernel", 10, 20),
            ev("kernel", 20, 20),  # 10..40, overlapping
            ev("gpu_memcpy", 50, 5),
            ev("kernel", 90, 10),  # 50..55, 90..100
            {"ph": "i", "cat": "kernel", "ts": 60},  # an instant event carries no duration
        ]
    }
    busy, span_ms = busy_fraction(trace)
    assert busy == pytest.approx(0.45) and span_ms == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="no GPU activity"):
        busy_fraction({"traceEvents": [ev("cpu_op", 0, 10)]})


def test_quantized_kv_page_check_runs_on_a_tiny_model(tmp_path: Path) -> None:
    """benchmarks/gpu's `kvpages` section on the CPU (no GPU backends: the torch rows and the penalties), so that
    the script a lease runs is known to work before device time is spent on it."""
    from benchmarks.gpu.check_correctness import kv_page_parity

    rows = kv_page_parity(torch.device("cpu"), tmp_path, [], smoke=True)
    assert [r["check"] for r in rows] == [
        "fp8_e4m3 pages vs bfloat16 pages (info)",
        "int8 pages vs bfloat16 pages (info)",
        "penalties float32 vs torch",
        "penalties float32 vs torch",
    ]
    assert all(r["ok"] for r in rows if r["ok"] is not None), rows
