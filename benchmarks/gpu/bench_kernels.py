"""Attention kernels alone: our Triton decode/extend kernels against FlashInfer on the same shapes and pool.

Each row times one layer's attention (the backend's `forward`: KV store + attention) after one `plan`, and puts
it beside the floor of reading that layer's KV once from device memory (decode is memory-bound). The Triton
kernels' register and spill counts come from the compiled kernels (spills move accumulators to local memory).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from benchmarks.gpu.check_correctness import random_batch
from benchmarks.gpu.common import median, time_ms
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.model.runner import make_backend

# name -> (prefix, extend) per request. Llama-3-8B heads (32 query, 8 KV, head_dim 128), bf16, page 16.
SHAPES: dict[str, list[tuple[int, int]]] = {
    "decode bs 1 ctx 2048": [(2047, 1)],
    "decode bs 32 ctx 2048": [(2047, 1)] * 32,
    "decode bs 128 ctx 2048": [(2047, 1)] * 128,
    "decode bs 32 ctx 8192": [(8191, 1)] * 32,
    "extend 1 x 8192 fresh": [(0, 8192)],
    "extend 8 x 512 on 2048 prefix": [(2048, 512)] * 8,
}


def kernel_resources(fn: Any) -> list[dict[str, Any]]:
    """Registers, spills and warps of every compiled variant of a Triton kernel (read off its device caches)."""
    rows = []
    for cache in getattr(fn, "device_caches", {}).values():
        for compiled in cache[0].values():
            compiled._init_handles()
            rows.append(
                {
                    "kernel": fn.__name__,
                    "num_warps": compiled.metadata.num_warps,
                    "regs": compiled.n_regs,
                    "spills": compiled.n_spills,
                }
            )
    return rows


def attention_kernels(
    device: torch.device,
    ceilings: dict[str, float],
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict[str, Any]]:
    shape = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": heads * head_dim,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
        }
    )
    bw = ceilings["copy_bytes_per_s"]
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(1)
    for name, lens in SHAPES.items():
        num_pages = 8 + sum(math.ceil((p + e) / page_size) for p, e in lens)
        pool = KVPool(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
        for buf in (pool.k_buffers[0], pool.v_buffers[0]):
            buf.normal_(generator=gen)
        batch = random_batch(lens, 0, page_size, num_pages, random.Random(2), device)
        tokens = batch.num_tokens
        q = torch.randn(tokens, heads, head_dim, generator=gen, device=device).to(dtype)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype)
        kv_bytes = 2 * sum(p + e for p, e in lens) * kv_heads * head_dim * dtype.itemsize
        io_bytes = (2 * q.numel() + k.numel() + v.numel()) * dtype.itemsize
        floor_ms = (kv_bytes + io_bytes) / bw * 1e3
        times = {}
        for backend in ("flashinfer", "triton"):
            attn = make_backend(backend, pool, shape)
            attn.plan(batch)
            times[backend] = median(time_ms(lambda a=attn: a.forward(0, q, k, v), device, warmup=5, iters=50))
            del attn
        rows.append(
            {
                "shape": name,
                "flashinfer_ms": times["flashinfer"],
                "triton_ms": times["triton"],
                "triton/flashinfer": times["triton"] / times["flashinfer"],
                "kv_floor_ms": floor_ms,
                "flashinfer floor/ms": floor_ms / times["flashinfer"],
                "triton floor/ms": floor_ms / times["triton"],
            }
        )
        del pool
    from radixserve_kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel
    from radixserve_kernels.extend_attention import _extend_kernel

    for fn in (_decode_split_kernel, _decode_merge_kernel, _extend_kernel):
        rows += [{"shape": "resources", **r} for r in kernel_resources(fn)]
    return rows
