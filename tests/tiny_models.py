"""Tiny random Llama-family checkpoints built with `transformers`, saved as real Hugging Face folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that the tiny head_dim has frequencies in all three llama3 bands.
    "original_max_position_embeddings": 256,
}


def tiny_hf_config(arch: str, vocab_size: int = 512, **overrides: Any) -> Any:
    """A transformers config for `arch`: hidden 64, 3 layers, 4 query heads over 2 KV heads of dim 16."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "llama3":
        cls = transformers.LlamaConfig
        common.update(rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE))
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        common.update(tie_word_embeddings=True, rope_theta=1000000.0)
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        common.update(rope_theta=1000000.0)
    elif arch == "mistral":
        cls = transformers.MistralConfig
        common.update(sliding_window=None)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    common.update(overrides)
    return cls(**common)


def make_tiny_checkpoint(out_dir: Path, arch: str, vocab_size: int = 512, seed: int = 0, **overrides: Any) -> Path:
    """Write config.json + model.safetensors of a tiny random float32 `arch` model into `out_dir`; returns `out_dir`.

    Every parameter is redrawn from a seeded generator (norm weights near 1, biases non-zero, weights std 0.1)
    so that a misplaced norm or bias changes the logits, and attention is peaked enough to expose mask bugs.
    `overrides` go to the transformers config (e.g. `num_hidden_layers=2`, `rope_scaling={...}`).
    """
    import transformers

    out_dir = Path(out_dir)
    config = tiny_hf_config(arch, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * (torch.rand(param.shape, generator=gen) - 0.5))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir
