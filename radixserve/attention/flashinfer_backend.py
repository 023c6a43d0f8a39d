"""Attention backend on FlashInfer's paged-KV wrappers (CUDA only; `flashinfer` is imported at construction).

A pure-decode step runs `BatchDecodeWithPagedKVCacheWrapper`; any step with a longer chunk runs
`BatchPrefillWithPagedKVCacheWrapper` with a causal mask aligned to the end of each request's keys. Both read our
pool's per-layer `[num_pages, page_size, kv_heads, head_dim]` buffers as FlashInfer's NHD layout, so no copy is
made. `plan` runs once per step (FlashInfer plans on the host from CPU indptrs) and every layer reuses it; `forward`
writes the step's new K/V into their pages first, so the kernels see prefix and new tokens alike.

For CUDA graphs (radixserve/model/cuda_graph.py): `init_cuda_graph` makes one graph-mode decode wrapper per batch
size over fixed index buffers, and `plan_cuda_graph` re-plans one of them before each replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.paged_metadata import PagedKVMetadata, build_paged_metadata
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.transfer import to_device

# FlashInfer's recommended split-KV scratch size; the decode and prefill wrappers share it (one runs per step).
MIN_WORKSPACE_BYTES = 128 << 20
# Graph-mode decode always splits KV; its float32 partial outputs and log-sum-exps grow with batch x query heads.
# 128 MB ran out capturing ~410 requests of 32x128 heads, i.e. about 19 splits' worth: budget 32 splits.
WORKSPACE_SPLITS = 32
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer's fp8 KV: pages of float8_e4m3fn, passed as kv_data_type to plan; with no k_scale / v_scale given to
# run, the scale is 1 (radixserve/cache/kv_format.py stores fp8 unscaled, clamped to its range).
KV_DTYPES = (*SUPPORTED_DTYPES, torch.float8_e4m3fn)
# "fa2" as SGLang and mini-sglang pin it: "auto" picks FA3 on sm90 for head_dim 128, slower for paged serving there,
# with a known bug on H100 PCIe, and one more JIT module per dtype.
DEFAULT_PREFILL_BACKEND = "fa2"


def workspace_bytes(max_batch_size: int, num_heads: int, head_dim: int) -> int:
    """Scratch for split-KV decode of `max_batch_size` requests (float32 partial outputs + lse per split)."""
    return max(MIN_WORKSPACE_BYTES, max_batch_size * num_heads * (head_dim + 1) * 4 * WORKSPACE_SPLITS)


def use_tensor_core_decode(num_heads: int, num_kv_heads: int) -> bool:
    """Tensor-core decode pays off once several query heads share a KV head (an MMA tile of them)."""
    return num_heads // num_kv_heads >= 4


def prefill_wrapper_kwargs(backend: str = DEFAULT_PREFILL_BACKEND) -> dict[str, Any]:
    """Keyword arguments of `BatchPrefillWithPagedKVCacheWrapper(workspace, ...)`: our pool's layout, a pinned
    kernel backend."""
    return dict(kv_layout="NHD", backend=backend)


def decode_plan_kwargs(
    meta: PagedKVMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> dict[str, Any]:
    """Keyword arguments of `BatchDecodeWithPagedKVCacheWrapper.plan` for a pure-decode batch (RoPE already applied)."""
    return dict(
        indptr=meta.kv_indptr,
        indices=meta.kv_indices,
        last_page_len=meta.kv_last_page_len,
        num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=meta.page_size,
        pos_encoding_mode="NONE",
        sm_scale=scale,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
    )


def prefill_plan_kwargs(
    meta: PagedKVMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> dict[str, Any]:
    """Keyword arguments of `BatchPrefillWithPagedKVCacheWrapper.plan`: causal over each request's prefix + new
    tokens."""
    return dict(
        qo_indptr=meta.qo_indptr,
        paged_kv_indptr=meta.kv_indptr,
        paged_kv_indices=meta.kv_indices,
        paged_kv_last_page_len=meta.kv_last_page_len,
        num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim,
        page_size=meta.page_size,
        causal=True,
        pos_encoding_mode="NONE",
        sm_scale=scale,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
    )


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer; `q_dtype` defaults to the model's dtype (the pool's compute dtype)."""

    def __init__(
        self,
        pool: KVPool,
        num_heads: int,
        head_dim: int,
        scale: float | None = None,
        q_dtype: torch.dtype | None = None,
        decode_tensor_cores: bool | None = None,
        max_batch_size: int = 256,
        prefill_backend: str = DEFAULT_PREFILL_BACKEND,
    ) -> None:
        super().__init__(pool, num_heads, head_dim, scale)
        # Checked before importing flashinfer: its wrappers allocate CUDA and pinned memory on construction.
        if pool.device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"the flashinfer attention backend needs a CUDA device; the KV pool is on {pool.device}")
        self.q_dtype = q_dtype or pool.compute_dtype
        if self.q_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"the flashinfer backend supports float16 and bfloat16; the query dtype is {self.q_dtype}")
        if pool.format.element not in KV_DTYPES:
            raise ValueError(
                f"the flashinfer backend reads KV pages of float16, bfloat16 or fp8_e4m3; kv_cache_dtype "
                f"{pool.format.name!r} runs on the torch backend"
            )
        self.num_kv_heads = pool.k_buffers[0].shape[2]
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of the KV heads ({self.num_kv_heads})")
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "attention_backend 'flashinfer' needs the flashinfer-python package "
                "(pip install flashinfer-python; it compiles its kernels with nvcc on first use)"
            ) from e
        self._flashinfer = flashinfer
        self.tensor_cores = (
            use_tensor_core_decode(num_heads, self.num_kv_heads) if decode_tensor_cores is None else decode_tensor_cores
        )
        self.max_batch_size = max_batch_size
        self.workspace = torch.zeros(
            workspace_bytes(max_batch_size, num_heads, head_dim), dtype=torch.uint8, device=pool.device
        )
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.tensor_cores
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, **prefill_wrapper_kwargs(prefill_backend)
        )
        self.graph_wrappers: dict[int, Any] = {}
        self._active: Any = None
        # `plan` fills a pinned host buffer and copies it to the device without waiting; the next plan must not
        # refill that buffer before the copy has run. This event marks the last plan's copy (as mini-sglang does).
        self._planned = torch.cuda.Event()
        self._planned.record()
        self.out_cache_loc = torch.zeros(0, dtype=torch.int64, device=pool.device)

    # ---- planning ---------------------------------------------------------------------------------------------
    def _shape(self) -> dict[str, Any]:
        return dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.scale,
            q_dtype=self.q_dtype,
            kv_dtype=self.pool.format.element,
        )

    def plan(self, batch: ForwardBatch) -> None:
        """Plan the decode or the prefill wrapper for this step; every layer's `forward` reuses the plan."""
        self.out_cache_loc = to_device(batch.out_cache_loc, self.pool.device)
        if batch.batch_size == 0:
            self._active = None
            return
        meta = build_paged_metadata(batch)
        if batch.is_decode:
            self._plan(self.decode_wrapper, decode_plan_kwargs(meta, **self._shape()))
        else:
            self._plan(self.prefill_wrapper, prefill_plan_kwargs(meta, **self._shape()))

    def _plan(self, wrapper: Any, kwargs: dict[str, Any]) -> None:
        self._planned.synchronize()  # the previous plan's host-to-device copy has run: its pinned buffer is free
        wrapper.plan(**kwargs)
        self._planned.record()
        self._active = wrapper

    # ---- CUDA graphs ------------------------------------------------------------------------------------------
    def init_cuda_graph(self, batch_sizes: Sequence[int], max_pages_per_request: int) -> None:
        """Fixed index buffers and one graph-mode decode wrapper per batch size (they share the buffers)."""
        device, max_bs = self.pool.device, max(batch_sizes)
        if max_bs > self.max_batch_size:
            raise ValueError(f"graph batch size {max_bs} exceeds the workspace's max_batch_size {self.max_batch_size}")
        self._graph_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_indices = torch.zeros(max_bs * max_pages_per_request, dtype=torch.int32, device=device)
        self._graph_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.graph_wrappers = {
            bs: self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
            )
            for bs in batch_sizes
        }

    def plan_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan a (padded) pure-decode batch whose size is one of `init_cuda_graph`'s, into the fixed buffers.

        Called before capture and before every replay: the captured kernels read these buffers' addresses.
        """
        bs = batch.batch_size
        if not batch.is_decode or bs not in self.graph_wrappers:
            raise ValueError(f"no CUDA-graph decode wrapper for a batch of {bs} (decode: {batch.is_decode})")
        self._graph_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        self.out_cache_loc = self._graph_loc[:bs]
        self._plan(self.graph_wrappers[bs], decode_plan_kwargs(build_paged_metadata(batch), **self._shape()))

    # ---- per layer --------------------------------------------------------------------------------------------
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v at the planned slots, then attend; q `[T, H, D]` -> `[T, H, D]` in q's dtype."""
        self.pool.store(layer_id, self.out_cache_loc, k, v)  # no host sync: safe inside a CUDA-graph capture
        if q.shape[0] == 0 or self._active is None:
            return torch.empty_like(q)
        element = self.pool.format.element  # fp8 pages are held as uint8 bits: FlashInfer reads them as float8
        kv = (self.pool.k_buffers[layer_id].view(element), self.pool.v_buffers[layer_id].view(element))
        return self._active.run(q.contiguous(), kv)
