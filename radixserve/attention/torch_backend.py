"""Reference attention backend in plain PyTorch: gather each request's KV pages, one SDPA call per request group.

Requests are split into a decode group (one new token each: the hot path) and an extend group (prefill chunks,
padded to the longest), so a long prefill chunk does not pad every decode token to its length. Index and mask
tensors are built once in `plan` and reused by every layer.

On CPU the decode group runs our fused C++ op instead (radixserve_kernels/cpu/decode_attention.cpp: it reads K/V in
place from the pool's pages, no gather copy) when the CPU kernels are built and the pool is float32, bfloat16 or int8;
RADIXSERVE_CPU_KERNELS=0 keeps everything on the SDPA path. Quantized pages (int8, fp8_e4m3) are decoded to the
query's dtype right after the gather, so SDPA sees exactly the dequantized float pages. In deterministic mode
(radixserve/model/deterministic.py) every token, prompt or decode, is a row of that op over keys 0 .. its position,
so a row's result does not depend on how its prompt was chunked or how much of it came from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import radixserve_kernels.cpu
from radixserve.attention.base import AttentionBackend, DecodeOpStep
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch


# What the C++ decode op reads: float32, bfloat16 and int8 pages (radixserve_kernels/cpu/decode_attention.cpp).
CPU_OP_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


@dataclass
class _Group:
    """Requests attended together: `q_len` (padded) queries each, keys gathered from `pages` `[G, P]`."""

    rows: torch.Tensor | None  # packed rows of the group's tokens, request by request; None: all rows, in order
    pad_index: torch.Tensor | None  # each token's slot in the padded [G * q_len] query layout; None when q_len == 1
    pages: torch.Tensor  # [G * P] pool pages holding keys 0 .. P * page_size - 1 of each request
    bias: torch.Tensor | None  # [G, 1, q_len, P * page_size] additive mask: 0 = may attend, -inf = may not
    num_reqs: int
    q_len: int
    # Every request starts at position 0 (fresh prefills): plain causal attention over the first q_len keys,
    # no mask, which lets SDPA skip the masked blocks.
    causal: bool
    # Decode group on the CPU op: each request's page-table row `[G, P]` and its length `[G]`, int32 (pages is
    # then unused and bias None).
    table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


class TorchAttentionBackend(AttentionBackend):
    """Paged causal attention with `torch.nn.functional.scaled_dot_product_attention`; runs on any device."""

    use_cpu_kernels = True  # False: the decode group takes the SDPA path even where the C++ op is available
    batch_invariant_path = True  # deterministic: every token attends as a decode row (needs the C++ op)

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__(pool, num_heads, head_dim, scale)
        # Here, not at the first step: a first build of the CPU kernels takes a while (then cached on disk).
        self._ops = radixserve_kernels.cpu.ops() if pool.device.type == "cpu" and pool.dtype in CPU_OP_DTYPES else None

    def plan(self, batch: ForwardBatch) -> None:
        """Build the gather indices and masks of this step's decode and extend groups."""
        self.out_cache_loc = batch.out_cache_loc
        self.num_kv_heads = self.pool.k_buffers[0].shape[2]
        self.cpu_ops = self._ops if self.use_cpu_kernels else None
        if self.deterministic:
            self.groups = [self._token_rows(batch)]
            return
        ext = batch.extend_lens.long()
        decode = torch.nonzero(ext == 1).flatten()
        extend = torch.nonzero(ext > 1).flatten()
        self.groups: list[_Group] = []
        if decode.numel():
            all_rows = decode.numel() == batch.batch_size
            self.groups.append(
                self._group(batch, decode, 1, None if all_rows else batch.qo_indptr[decode].long(), None)
            )
        if extend.numel():
            lens = ext[extend]
            q_len = int(lens.max())
            offsets = torch.cumsum(lens, 0) - lens
            within = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets, lens)
            rows = torch.repeat_interleave(batch.qo_indptr[extend].long(), lens) + within
            pad_index = torch.repeat_interleave(torch.arange(extend.numel()) * q_len, lens) + within
            self.groups.append(self._group(batch, extend, q_len, rows, pad_index))

    def _token_rows(self, batch: ForwardBatch) -> _Group:
        """One decode-op row per packed token: token i of request r attends over keys 0 .. prefix_lens[r] + i, read
        from r's pages (its own K/V is stored before the op runs)."""
        if self.cpu_ops is None:
            raise RuntimeError("deterministic attention needs the CPU decode_attention op")
        if batch.is_decode:  # one row per request over all its keys: the same rows, without the index arithmetic
            return self._op_rows(batch, torch.arange(batch.batch_size), batch.seq_lens, None)
        ext = batch.extend_lens.long()
        req = torch.repeat_interleave(torch.arange(ext.numel()), ext)
        within = torch.arange(int(ext.sum())) - torch.repeat_interleave(batch.qo_indptr[:-1].long(), ext)
        return self._op_rows(batch, req, batch.prefix_lens.long()[req] + within + 1, None)

    @staticmethod
    def _op_rows(batch: ForwardBatch, reqs: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor | None) -> _Group:
        """Rows of the CPU decode op: row j queries keys 0 .. seq_lens[j] - 1 of request reqs[j]."""
        longest = int(seq_lens.max()) if seq_lens.numel() else 0
        pages = (longest + batch.page_size - 1) // batch.page_size
        table = batch.page_table[reqs, :pages].to(torch.int32).contiguous()
        return _Group(
            rows=rows,
            pad_index=None,
            pages=table,  # unused: the op reads `table`
            bias=None,
            num_reqs=int(reqs.numel()),
            q_len=1,
            causal=False,
            table=table,
            seq_lens=seq_lens.to(torch.int32).contiguous(),
        )

    def _group(
        self,
        batch: ForwardBatch,
        reqs: torch.Tensor,
        q_len: int,
        rows: torch.Tensor | None,
        pad_index: torch.Tensor | None,
    ) -> _Group:
        ps = batch.page_size
        device = batch.page_table.device
        if q_len == 1 and self.cpu_ops is not None:
            return self._op_rows(batch, reqs, batch.seq_lens[reqs], None if rows is None else rows.to(device))
        num_pages = (int(batch.seq_lens[reqs].max()) + ps - 1) // ps
        # Query i of request r sits at position prefix_lens[r] + i and sees keys 0 .. prefix_lens[r] + i.
        # Padded queries (i >= extend_len) see only real-or-stale finite keys; their output is discarded.
        prefix = batch.prefix_lens[reqs].long()
        causal = q_len > 1 and not bool(prefix.any())
        bias = None
        if not causal:
            mask = (
                torch.arange(num_pages * ps)[None, None, :]
                <= prefix[:, None, None] + torch.arange(q_len)[None, :, None]
            )
            # Additive, in the pool's dtype: SDPA would otherwise convert a boolean mask in every layer.
            bias = (
                torch.zeros(mask.shape, dtype=self.pool.compute_dtype)
                .masked_fill_(~mask, float("-inf"))
                .unsqueeze(1)
                .to(device)
            )
        return _Group(
            rows=None if rows is None else rows.to(device),
            pad_index=None if pad_index is None else pad_index.to(device),
            pages=batch.page_table[reqs.to(device), :num_pages].long().flatten(),
            bias=bias,
            num_reqs=int(reqs.numel()),
            q_len=q_len,
            causal=causal,
        )

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v at the planned slots, then attend; q `[T, H, D]` -> `[T, H, D]` in q's dtype."""
        self.pool.store(layer_id, self.out_cache_loc, k, v)
        k_pages, v_pages = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        if len(self.groups) == 1 and self.groups[0].rows is None:
            return self._attend(self.groups[0], q, k_pages, v_pages)
        out = torch.empty_like(q)
        for g in self.groups:
            assert g.rows is not None
            # index_select / index_copy_: advanced indexing is many times slower on CPU, in bf16 above all.
            out.index_copy_(0, g.rows, self._attend(g, q.index_select(0, g.rows), k_pages, v_pages))
        return out

    def decode_op_step(self, dtype: torch.dtype) -> DecodeOpStep | None:
        if self.cpu_ops is None or len(self.groups) != 1:
            return None
        g = self.groups[0]
        store = self.pool.store_op(dtype)
        if g.rows is not None or g.table is None or g.seq_lens is None or store is None:
            return None
        p = self.pool
        return DecodeOpStep(
            p.k_buffers, p.v_buffers, self.out_cache_loc, g.table, g.seq_lens, self.scale, store == "int8"
        )

    def _attend(self, g: _Group, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """Attention for one group; q holds the group's tokens `[n, H, D]` in request order. int8 keys and values are
        stored rotated (radixserve/cache/kv_format.py): the query is rotated to match and the output rotated back (by
        the C++ op itself; here each rounded back to q's dtype, for SDPA)."""
        fmt = self.pool.format
        if g.table is not None:
            return self.cpu_ops.decode_attention(q, k_pages, v_pages, g.table, g.seq_lens, self.scale)
        return fmt.unrotate_values(self._sdpa(g, fmt.rotate(q).to(q.dtype), k_pages, v_pages)).to(q.dtype)

    def _sdpa(self, g: _Group, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """SDPA over the group's gathered pages, decoded to q's dtype (for int8, all in the rotated space)."""
        fmt = self.pool.format
        n, heads, dim = q.shape
        kv = self.num_kv_heads
        keys = fmt.decode(self._gather(k_pages, g), q.dtype, "k")  # [G, KV, P * page_size, D]
        values = fmt.decode(self._gather(v_pages, g), q.dtype, "v")
        bias = None if g.bias is None else g.bias.to(q.dtype)
        if g.pad_index is None:
            # Decode: the query heads sharing a KV head become that head's queries (q_len = gqa ratio), which is
            # ~10x faster on CPU than SDPA's enable_gqa with one query per head.
            o = F.scaled_dot_product_attention(
                q.reshape(n, kv, heads // kv, dim), keys, values, attn_mask=bias, scale=self.scale
            )
            return o.reshape(n, heads, dim)
        padded = q.new_zeros(g.num_reqs * g.q_len, heads, dim).index_copy_(0, g.pad_index, q)
        padded = padded.view(g.num_reqs, g.q_len, heads, dim).transpose(1, 2)
        if g.causal:  # keys past q_len are padding here; dropping them keeps the causal mask square
            keys, values = keys[:, :, : g.q_len], values[:, :, : g.q_len]
        o = F.scaled_dot_product_attention(
            padded, keys, values, attn_mask=bias, is_causal=g.causal, scale=self.scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(g.num_reqs * g.q_len, heads, dim).index_select(0, g.pad_index)

    @staticmethod
    def _gather(pages: torch.Tensor, g: _Group) -> torch.Tensor:
        """Pool pages `[num_pages, page_size, KV, W]` -> the group's stored rows `[G, KV, P * page_size, W]` (a strided
        view; W is the row width: head_dim, or for int8 head_dim and its scales' bytes)."""
        # index_select copies whole pages; advanced indexing (pages[idx]) is ~20x slower on CPU in bf16.
        flat = pages.index_select(0, g.pages)
        return flat.view(g.num_reqs, -1, *pages.shape[2:]).transpose(1, 2)
