"""The floors a step cannot beat: bytes a decode step must read, FLOPs a prefill must do (pure arithmetic, no GPU).

Decode reads every weight once per step (the embedding only for the batch's rows) and every request's KV once;
divided by the measured copy bandwidth that is the memory floor. Prefill FLOPs count the matmuls (2 per
multiply-add) and causal attention (QK^T and PV over the lower triangle), the LM head only for the rows whose logits
are computed; divided by the measured bf16 matmul rate that gives MFU.
"""

from __future__ import annotations

from radixserve.cache.kv_pool import kv_bytes_per_token
from radixserve.config import ModelConfig


def linear_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: fused qkv, o_proj, fused gate/up, down_proj."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size


def total_params(cfg: ModelConfig) -> int:
    """All parameters (linear layers, norms, embedding, untied LM head); biases of Qwen2-style q/k/v included."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = linear_params_per_layer(cfg) + 2 * cfg.hidden_size
    per_layer += (q + 2 * kv) if cfg.attention_bias else 0
    per_layer += 2 * cfg.head_dim if cfg.qk_norm else 0
    embed = cfg.vocab_size * cfg.hidden_size
    return cfg.num_layers * per_layer + cfg.hidden_size + embed + (0 if cfg.tie_word_embeddings else embed)


def decode_step_bytes(cfg: ModelConfig, batch_size: int, context_len: int, dtype_bytes: int) -> int:
    """Least device-memory traffic of one decode step: weights once, each request's KV (context_len tokens) once,
    the new token's KV written, the embedding rows of the batch."""
    embed = cfg.vocab_size * cfg.hidden_size
    weights = (total_params(cfg) - embed) * dtype_bytes  # the LM head stays (it is the embedding when tied)
    if cfg.tie_word_embeddings:
        weights += embed * dtype_bytes
    rows = batch_size * cfg.hidden_size * dtype_bytes
    kv = (
        batch_size * (context_len + 1) * kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype_bytes)
    )
    return weights + rows + kv


def prefill_flops(cfg: ModelConfig, tokens: int, prefix_len: int = 0, logits_rows: int = 1) -> float:
    """FLOPs of one request's prefill of `tokens` new tokens after `prefix_len` cached ones (causal attention)."""
    matmuls = 2.0 * tokens * linear_params_per_layer(cfg) * cfg.num_layers
    # Query i (0-based) sees prefix_len + i + 1 keys; QK^T and PV are 2 * head_dim FLOPs per key each.
    keys_seen = tokens * prefix_len + tokens * (tokens + 1) / 2
    attention = 4.0 * cfg.head_dim * cfg.num_heads * cfg.num_layers * keys_seen
    lm_head = 2.0 * logits_rows * cfg.hidden_size * cfg.vocab_size
    return matmuls + attention + lm_head
