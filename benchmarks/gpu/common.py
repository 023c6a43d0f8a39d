"""Shared pieces of the GPU checks and benchmarks: model shapes, random models built on the device, timing, ceilings.

Random weights are drawn on the device (no weights travel to the GPU machine); never zeros, which can run faster
than real data. Timings use CUDA events around each repetition after warm-ups, and report the median.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from radixserve.config import ModelConfig
from radixserve.model.llama import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from tiny_tokenizer import build_tokenizer  # noqa: E402

# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B), with random weights.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# A small model with FlashInfer-friendly heads (head_dim 128, GQA 4) for correctness checks.
SMALL: dict[str, Any] = {
    **LLAMA3_8B,
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
# For a CPU smoke run of the scripts themselves.
TINY: dict[str, Any] = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}


def hf_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Llama checkpoint's tensors."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def random_tensor(
    shape: tuple[int, ...], std: float, gen: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Norm weights (1-D) near 1, matrices N(0, std^2): random, never zeros."""
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)


def build_random_model(
    cfg: dict[str, Any], dtype: torch.dtype, device: torch.device, std: float = 0.02, seed: int = 0
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The model built directly on `device` with random weights (no checkpoint on disk)."""
    config = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(random_tensor(tuple(param.shape), std, gen, device, dtype))
    model.rotary.reset_cache()
    return config, model.eval()


def write_random_checkpoint(
    out: Path, cfg: dict[str, Any], device: torch.device, std: float = 0.02, seed: int = 0, shard_bytes: int = 2 << 30
) -> Path:
    """A Hugging Face folder (config, bf16 safetensors shards + index, tiny test tokenizer); weights drawn on
    `device`. Reused when `out` already holds one for the same config."""
    marker = out / "config.json"
    if marker.is_file() and json.loads(marker.read_text()) == cfg and (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name))
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for name, shape in hf_weight_shapes(cfg).items():
        shard[name] = random_tensor(shape, std, gen, device, torch.bfloat16).cpu()
        size += shard[name].nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    build_tokenizer(out)
    marker.write_text(json.dumps(cfg, indent=2))  # written last: a folder cut short is rebuilt next time
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 20) -> list[float]:
    """Per-repetition milliseconds: CUDA events on a GPU, the host clock (after a sync) elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure_ceilings(device: torch.device, copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul rate, measured here."""
    src = torch.randn(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median(time_ms(partial(dst.copy_, src), device, warmup=3, iters=20))
    del src, dst
    gen = torch.Generator(device=device).manual_seed(1)
    # Three input pairs in rotation (each 128 MiB at n=8192, far above L2), random, never zeros.
    pairs = [
        (
            torch.randn(matmul_n, matmul_n, generator=gen, device=device, dtype=torch.bfloat16),
            torch.randn(matmul_n, matmul_n, generator=gen, device=device, dtype=torch.bfloat16),
        )
        for _ in range(3)
    ]
    turn = iter(range(1 << 30))

    def mm() -> None:
        a, b = pairs[next(turn) % 3]
        torch.matmul(a, b)

    mm_ms = median(time_ms(mm, device, warmup=3, iters=15))
    return {
        "copy_bytes_per_s": 2 * copy_bytes / (copy_ms / 1e3),
        "copy_ms": copy_ms,
        "matmul_flops_per_s": 2 * matmul_n**3 / (mm_ms / 1e3),
        "matmul_ms": mm_ms,
        "matmul_n": matmul_n,
    }


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Rows as a Markdown table (floats to 4 significant digits)."""

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
