"""The attention backend interface: `plan` once per step, then `forward` per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DecodeOpStep:
    """A step whose every token is a row of the CPU decode op, stored by a C++ op: what
    radixserve_kernels/cpu/decoder_stack.cpp needs to store and attend in every layer as `forward` would."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    out_cache_loc: torch.Tensor  # int64 slots of the step's tokens
    table: torch.Tensor  # [T, P] int32 page table, a row per token
    seq_lens: torch.Tensor  # [T] int32 keys each row attends over
    scale: float
    int8: bool  # pages quantized by store_kv_int8; else copied by store_kv


class AttentionBackend(ABC):
    """Writes each step's new K/V into the pool and attends over prefix pages plus the new tokens, causally."""

    # A backend with a batch-invariant path (radixserve/model/deterministic.py) sets `batch_invariant_path`; then
    # `deterministic = True` makes every row's result a function of that row and its keys alone.
    batch_invariant_path = False
    deterministic = False

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata (page tables, lengths, indptrs) shared by every layer."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[T, num_heads, head_dim]`, k/v `[T, kv_heads, head_dim]` -> output `[T, num_heads, head_dim]`."""

    def decode_op_step(self, dtype: torch.dtype) -> DecodeOpStep | None:
        """After `plan`: this step as DecodeOpStep when `forward` would store k/v of `dtype` with a C++ op and attend
        every row with the CPU decode op; None where it takes another path."""
        return None
