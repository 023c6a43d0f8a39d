"""Key centering for int8 KV pages (issue 40): each layer's keys are stored as k - c, c fixed per KV head.

Softmax over q . k_j is unchanged when every key of a head moves by the same vector c (each score moves by q . c,
the same for every j), so centered keys give the same attention. They quantize far better in models whose keys
are mostly their k_proj bias: Qwen2.5's layer-0 keys have a mean of norm ~270 per KV head (their rms norm: 278),
so an int8 scale sized by the mean rounds the rest coarsely (RESULTS.md, issue 40, sessions 12-13).

The bias b is added before RoPE, so at position p a rotary pair holds R(theta p) b: a pair that turns by phi is left
|R(phi) b - b| = 2 |b| sin(phi / 2) off center by c = b, more than |b| (c = 0) once phi > pi/3. So c is b on the
pairs that turn by less than pi/3 over CENTER_SPAN positions (or the model's context, if shorter), zero on the rest.
Most of Qwen2.5's large biases sit on those slow pairs (94-99.8% of the bias in its layers 0-2 and 8).

The center is subtracted in the model, after RoPE and before attention, so every reader and writer (the C++
store and decode op, SDPA, Triton, speculative verify, partial-page copies, TP shards with their own bias slice)
sees the same centered keys: the new keys of a step always agree with the stored ones. A model without a k bias
has nothing to center.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.rope import rope_inv_freq

# Positions over which a centered pair must stay within pi/3 of its bias. Chosen over the model's whole context
# (32,768 for Qwen2.5: 8 of 32 pairs centered rather than 11) on two texts at 4k and 8k tokens (RESULTS.md).
CENTER_SPAN = 8192


def slow_pairs(config: ModelConfig) -> torch.Tensor:
    """`[head_dim]` bool: the channels of the rotary pairs (i, i + head_dim / 2) that turn by less than pi/3 over
    min(CENTER_SPAN, the context) positions."""
    span = min(CENTER_SPAN, config.max_position_embeddings)
    inv_freq, _ = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
    return (inv_freq * span < math.pi / 3).repeat(2)


def key_center(attn: nn.Module, slow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The k bias slice of an Attention's fused qkv bias on the `slow` channels, `[num_kv_heads, head_dim]` in
    `dtype`, or None without a bias (under TP this rank's qkv_proj holds its own heads' rows, q | k | v as ever)."""
    bias = attn.qkv_proj.bias
    if bias is None:
        return None
    k_bias = bias.detach()[attn.q_size : attn.q_size + attn.kv_size].float().reshape(attn.num_kv_heads, -1)
    return (k_bias * slow.to(k_bias.device)).to(dtype)


def center_keys(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every layer's attention its key center (activations in `dtype`); a model without layers or without a
    k bias is left as it is."""
    slow = slow_pairs(model.config)
    for layer in getattr(model, "layers", ()):
        layer.self_attn.k_center = key_center(layer.self_attn, slow, dtype)
