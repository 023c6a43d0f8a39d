"""Key centering for int8 KV pages (issue 40): each layer's keys are stored as k - c, c fixed per KV head.

Softmax over q . k_j is unchanged when every key of a head moves by the same vector c (each score moves by q . c,
the same for every j), so centered keys give the same attention. They quantize far better in models whose keys
are mostly their k_proj bias: Qwen2.5's layer-0 keys have a mean of norm ~270 per KV head and spread of a few
units around it, which a per-16 int8 scale sized by the mean rounds away (RESULTS.md, issue 40, session 13).

The center is subtracted in the model, after RoPE and before attention, so every reader and writer (the C++
store and decode op, SDPA, Triton, speculative verify, partial-page copies, TP shards with their own bias slice)
sees the same centered keys: the new keys of a step always agree with the stored ones. A model without a k bias
has nothing to center.
"""

from __future__ import annotations

import torch
from torch import nn


def key_center(attn: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The k bias slice of an Attention's fused qkv bias as `[num_kv_heads, head_dim]` in `dtype`, or None without
    a bias (this rank's slice under TP: its qkv_proj holds its own heads' rows in the same q | k | v order)."""
    bias = attn.qkv_proj.bias
    if bias is None:
        return None
    k_bias = bias.detach()[attn.q_size : attn.q_size + attn.kv_size]
    return k_bias.to(dtype).reshape(attn.num_kv_heads, attn.head_dim).clone()


def center_keys(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every layer's attention its key center (activations in `dtype`); a model without layers or without a
    k bias is left as it is."""
    for layer in getattr(model, "layers", ()):
        layer.self_attn.k_center = key_center(layer.self_attn, dtype)
