"""Attention backend on our Triton kernels (radixserve_kernels/): paged decode with split-KV, paged extend, KV store.

On a CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 set before `radixserve_kernels`
is imported), which is for tests: it is correct but slow.

In deterministic mode (radixserve/model/deterministic.py) every step, decode included, runs the extend kernel's
batch-invariant variant: one kernel with fixed blocks for every token, keys read from the pages at fixed absolute
positions, no split-KV (whose split count follows the batch size). A decode token then attends as a one-token
extend, as it does in a speculative verify step or after a cache hit that leaves one prompt token to compute.
"""

from __future__ import annotations

import torch

from radixserve_kernels.common import is_interpreted
from radixserve_kernels.decode_attention import (
    _decode_split_kernel,
    decode_attention,
    decode_num_splits,
    decode_workspace,
)
from radixserve_kernels.extend_attention import extend_attention
from radixserve_kernels.kv_store import store_kv
from radixserve.attention.base import AttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.transfer import to_device


class TritonAttentionBackend(AttentionBackend):
    """A pure-decode step (one new token per request) runs the decode kernel; any other step runs extend."""

    batch_invariant_path = True  # deterministic: every step runs the extend kernel's batch-invariant variant

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__(pool, num_heads, head_dim, scale)
        if pool.device.type != "cuda" and not is_interpreted(_decode_split_kernel):
            raise RuntimeError(
                f"the triton attention backend needs a CUDA device; on {pool.device.type} set TRITON_INTERPRET=1 "
                "before anything imports `radixserve_kernels` (interpreter mode is for tests)"
            )
        if pool.format.quantized and not pool.format.scaled:
            # The kernels read float rows and int8 rows with their scale (radixserve_kernels/kv_load.py); fp8 pages are
            # held as uint8 bits, which they would read as integers: refuse rather than attend over wrong values.
            raise ValueError(
                f"the triton attention backend reads float and int8 KV pages; kv_cache_dtype {pool.format.name!r} "
                "runs on the torch backend or flashinfer on CUDA"
            )
        self.num_kv_heads = pool.k_buffers[0].shape[2]
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of the KV heads ({self.num_kv_heads})")
        # Split-KV targets about two waves of programs; the interpreter gains nothing from more programs.
        self.num_sms = (
            torch.cuda.get_device_properties(pool.device).multi_processor_count if pool.device.type == "cuda" else 1
        )

    def plan(self, batch: ForwardBatch) -> None:
        """Move this step's index tensors to the device as int32 once; every layer reuses them."""
        device = self.pool.device
        self.batch_size = batch.batch_size
        self.out_cache_loc = to_device(batch.out_cache_loc, device)
        self.page_table = to_device(batch.page_table, device).to(torch.int32).contiguous()
        self.is_decode = not self.deterministic and bool(batch.batch_size) and bool((batch.extend_lens == 1).all())
        if self.is_decode:
            self.seq_lens = to_device(batch.seq_lens.to(torch.int32), device)
            self.num_splits = decode_num_splits(
                batch.batch_size, self.num_kv_heads, int(batch.seq_lens.max()), self.num_sms
            )
            self.workspace = decode_workspace(batch.batch_size, self.num_heads, self.head_dim, self.num_splits, device)
        else:
            self.qo_indptr = to_device(batch.qo_indptr.to(torch.int32), device)
            self.prefix_lens = to_device(batch.prefix_lens.to(torch.int32), device)
            self.max_extend_len = int(batch.extend_lens.max()) if batch.batch_size else 0

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Store k/v at the planned slots, then attend; q `[T, H, D]` -> `[T, H, D]` in q's dtype (into `out` if given)."""
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if not self.pool.format.scaled and k_buf.dtype != k.dtype:
            # Narrower float pages (bfloat16 under float32 activations) get k/v rounded here, by torch (to nearest
            # even; the Triton interpreter's cast truncates): the store then moves raw bits, and the extend kernel
            # reads the new tokens as the pages hold them, as the torch backend and every later step see them.
            k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
        if self.pool.format.scaled:
            self.pool.store(layer_id, self.out_cache_loc, k, v)  # int8 quantizes as it stores (torch ops, capturable)
        else:
            store_kv(k_buf, v_buf, self.out_cache_loc, k, v)
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        fmt = self.pool.format
        if not fmt.scaled:
            return self._attend(q, k, v, out, k_buf, v_buf)
        # int8 keys and values are stored rotated (radixserve/cache/kv_format.py): so is the query, and the output,
        # a sum of rotated values, is rotated back.
        if not self.deterministic:
            # The extend kernel reads the new tokens from k/v, not the pages: give them as the pages hold them, as
            # the torch backend (which reads them back from the pool) and every later step see them.
            k = fmt.decode(fmt.encode(fmt.rotate(k), "k"), q.dtype, "k")
            v = fmt.decode(fmt.encode(fmt.rotate_values(v), "v"), q.dtype, "v")
        self._attend(fmt.rotate(q).to(q.dtype), k, v, out, k_buf, v_buf)
        return out.copy_(fmt.unrotate_values(out))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
    ) -> torch.Tensor:
        """The decode or extend kernel into `out` (k/v: the new tokens, which only extend reads)."""
        if self.is_decode:
            return decode_attention(
                q, k_buf, v_buf, self.page_table, self.seq_lens, out, self.scale, self.num_splits, self.workspace
            )
        return extend_attention(
            q,
            k,
            v,
            out,
            k_buf,
            v_buf,
            self.page_table,
            self.qo_indptr,
            self.prefix_lens,
            self.max_extend_len,
            self.scale,
            batch_invariant=self.deterministic,
        )
