"""Model-level GPU benchmarks: decode step time against the memory floor, and 8k-token prefill MFU.

The model (Llama-3-8B-shaped, random bf16) and a KV pool filled with random values are built on the device once;
each backend runs over the same pool. A decode step is what the engine runs per step: plan, the model, the LM
head for every request (and with CUDA graphs: pad, plan, replay).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

import radixserve_kernels.cuda_ops as cuda_ops

from benchmarks.gpu.common import build_random_model, median, sync, time_ms
from benchmarks.gpu.roofline import decode_step_bytes, prefill_flops
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.runner import make_backend


def decode_batch(
    batch_size: int,
    context: int,
    page_size: int,
    pages: list[int],
    vocab: int,
    device: torch.device,
) -> ForwardBatch:
    """`batch_size` requests with `context` cached tokens each and one new token, on disjoint pages from `pages`."""
    per = math.ceil((context + 1) / page_size)
    tables = [pages[i * per : (i + 1) * per] for i in range(batch_size)]
    ids = [[(7 * i + 3) % (vocab - 3) + 3] for i in range(batch_size)]
    return ForwardBatch.build(ids, [context] * batch_size, tables, page_size, list(range(batch_size)), device)


def wall_ms(fn: Callable[[], object], device: torch.device, iters: int = 20) -> float:
    """Host time per call of `iters` back-to-back calls, one sync at the end: includes the CPU work between steps."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def eager_step(model: LlamaForCausalLM, attn: Any, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        attn.plan(batch)
        return model.compute_logits(model(batch, attn)[batch.logits_indices])

    return step


def kernel_profile(step: Callable[[], object], bench: str, backend: str, top: int = 12) -> list[dict[str, Any]]:
    """One eager step under the profiler (device activity only): kernels launched, and the costliest by total time.
    Many kernels of a few microseconds each in a step bound by reading weights mean launch and tail overhead."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    total_us = sum(e.device_time for e in kernels)
    rows: list[dict[str, Any]] = [
        {
            "bench": f"profile {bench}",
            "backend": backend,
            "mode": "eager",
            "kernels": len(kernels),
            "kernel_ms": total_us / 1e3,
        }
    ]
    rows += [
        {
            "bench": f"profile {bench}",
            "backend": backend,
            "kernel": name[:60],
            "calls": len(ts),
            "kernel_ms": sum(ts) / 1e3,
            "mean_us": sum(ts) / len(ts),
        }
        for name, ts in ranked
    ]
    return rows


def model_benchmarks(
    device: torch.device,
    cfg: dict[str, Any],
    ceilings: dict[str, float],
    backends: list[str],
    batch_sizes: tuple[int, ...],
    context: int,
    prefill_tokens: int,
    use_graphs: bool,
    page_size: int = 16,
    fused_modes: tuple[bool, ...] = (True, False),
) -> list[dict[str, Any]]:
    """Decode at each batch size (eager per backend, plus CUDA graphs for flashinfer) and one prefill per backend,
    with FlashInfer's fused norm/activation/RoPE ops (radixserve_kernels/cuda_ops.py) on and off."""
    dtype = torch.bfloat16
    config, model = build_random_model(cfg, dtype, device)
    per = math.ceil((context + 1) / page_size)
    num_pages = 1 + max(max(batch_sizes) * per, math.ceil(prefill_tokens / page_size))
    pool = KVPool(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for buf in pool.k_buffers + pool.v_buffers:  # random KV, never zeros
        buf.normal_(generator=gen)
    pages = list(range(1, num_pages))
    random.Random(0).shuffle(pages)
    bw, mm = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name in backends:
            for fused in fused_modes:
                # Off: every caller of radixserve_kernels/cuda_ops.py sees no fused ops and runs the torch ops instead.
                with contextlib.nullcontext() if fused else mock.patch.object(cuda_ops, "for_tensor", _no_ops):
                    label = f"{name}{'' if fused else ' unfused'}"
                    rows += _backend_rows(
                        model,
                        config,
                        pool,
                        pages,
                        label,
                        name,
                        bw,
                        mm,
                        batch_sizes,
                        context,
                        prefill_tokens,
                        use_graphs and device.type == "cuda",
                        page_size,
                    )
    return rows


def _no_ops(x: torch.Tensor) -> None:
    return None


def _backend_rows(
    model: LlamaForCausalLM,
    config: Any,
    pool: KVPool,
    pages: list[int],
    label: str,
    name: str,
    bw: float,
    mm: float,
    batch_sizes: tuple[int, ...],
    context: int,
    prefill_tokens: int,
    use_graphs: bool,
    page_size: int,
) -> list[dict[str, Any]]:
    """One backend's rows (labelled `label`): graph capture, a kernel profile, decode per batch size, prefill."""
    device = pool.device
    rows: list[dict[str, Any]] = []
    attn = make_backend(name, pool, config)
    modes: list[tuple[str, Any]] = [("eager", None)]
    if use_graphs and name == "flashinfer":
        from radixserve.model.cuda_graph import CudaGraphRunner

        t0 = time.perf_counter()
        runner = CudaGraphRunner(model, attn, max(batch_sizes), context + page_size)
        rows.append(
            {
                "bench": "cuda graph capture",
                "backend": label,
                "mode": f"{len(runner.sizes)} graphs",
                "ms": (time.perf_counter() - t0) * 1e3,
            }
        )
        modes.append(("graph", runner))
    for bs in batch_sizes:
        batch = decode_batch(bs, context, page_size, pages, config.vocab_size, device)
        if bs == batch_sizes[0] and device.type == "cuda":
            try:
                rows += kernel_profile(eager_step(model, attn, batch), f"decode bs {bs} ctx {context}", label)
            except Exception as e:  # noqa: BLE001 - the profile explains; its failure must not hide timings
                rows.append({"bench": "profile", "backend": label, "error": repr(e)[:200]})
        floor_ms = decode_step_bytes(config, bs, context, model.embed_tokens.weight.dtype.itemsize) / bw * 1e3
        for mode, runner in modes:
            step = eager_step(model, attn, batch) if runner is None else (lambda r=runner: r.forward(batch))
            gpu = median(time_ms(step, device, warmup=3, iters=30))
            rows.append(
                {
                    "bench": f"decode bs {bs} ctx {context}",
                    "backend": label,
                    "mode": mode,
                    "ms": gpu,
                    "wall_ms": wall_ms(step, device),
                    "floor_ms": floor_ms,
                    "floor/ms": floor_ms / gpu,
                }
            )
    tables = [pages[: math.ceil(prefill_tokens / page_size)]]
    ids = [[(11 * t) % (config.vocab_size - 3) + 3 for t in range(prefill_tokens)]]
    batch = ForwardBatch.build(ids, [0], tables, page_size, [prefill_tokens - 1], device)
    ms = median(time_ms(eager_step(model, attn, batch), device, warmup=2, iters=5))
    flops = prefill_flops(config, prefill_tokens)
    rows.append(
        {
            "bench": f"prefill {prefill_tokens}",
            "backend": label,
            "mode": "eager",
            "ms": ms,
            "floor_ms": flops / mm * 1e3,
            "TFLOP/s": flops / ms / 1e9,
            "MFU": flops / (ms / 1e3) / mm,
        }
    )
    return rows
