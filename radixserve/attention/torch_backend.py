"""Reference attention backend in plain PyTorch: gather each request's KV pages, one SDPA call per request group.

Requests are split into a decode group (one new token each: the hot path) and an extend group (prefill chunks),
so a long prefill chunk does not pad every decode token to its length. Index and mask tensors are built once in
`plan` and reused by every layer. Grouped-query attention folds the query heads that share a KV head into the
query-length axis, so K/V are never repeated in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend
from radixserve.forward_batch import ForwardBatch


@dataclass
class _Group:
    """Requests attended together: `q_len` padded queries each, keys gathered from `pages` `[G, P]`."""

    rows: torch.Tensor | None  # packed rows of the group's tokens, request by request; None: all rows, in order
    pad_index: torch.Tensor | None  # each token's slot in the padded [G * q_len] query layout; None when q_len == 1
    pages: torch.Tensor  # [G, P] pool pages holding keys 0 .. P * page_size - 1
    mask: torch.Tensor  # [G, 1, q_len * gqa_ratio, P * page_size] bool, True = may attend
    num_reqs: int
    q_len: int


class TorchAttentionBackend(AttentionBackend):
    """Paged causal attention with `torch.nn.functional.scaled_dot_product_attention`; runs on any device."""

    def plan(self, batch: ForwardBatch) -> None:
        """Build the gather indices and masks of this step's decode and extend groups."""
        self.out_cache_loc = batch.out_cache_loc
        self.num_kv_heads = self.pool.k_buffers[0].shape[2]
        self.gqa_ratio = self.num_heads // self.num_kv_heads
        ext = batch.extend_lens.long()
        decode = torch.nonzero(ext == 1).flatten()
        extend = torch.nonzero(ext > 1).flatten()
        self.groups: list[_Group] = []
        if decode.numel():
            all_rows = decode.numel() == batch.batch_size
            self.groups.append(self._group(batch, decode, 1, None if all_rows else batch.qo_indptr[decode].long(), None))
        if extend.numel():
            lens = ext[extend]
            q_len = int(lens.max())
            offsets = torch.cumsum(lens, 0) - lens
            within = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets, lens)
            rows = torch.repeat_interleave(batch.qo_indptr[extend].long(), lens) + within
            pad_index = torch.repeat_interleave(torch.arange(extend.numel()) * q_len, lens) + within
            self.groups.append(self._group(batch, extend, q_len, rows, pad_index))

    def _group(self, batch: ForwardBatch, reqs: torch.Tensor, q_len: int, rows: torch.Tensor | None,
               pad_index: torch.Tensor | None) -> _Group:
        ps = batch.page_size
        device = batch.page_table.device
        num_pages = (int(batch.seq_lens[reqs].max()) + ps - 1) // ps
        key_pos = torch.arange(num_pages * ps)
        # Query i of request r sits at position prefix_lens[r] + i and sees keys 0 .. prefix_lens[r] + i.
        # Padded queries (i >= extend_len) see only real-or-stale finite keys; their output is discarded.
        last = batch.prefix_lens[reqs].long()[:, None] + torch.arange(q_len)[None, :]
        mask = key_pos[None, None, :] <= last[:, :, None]  # [G, q_len, K]
        mask = mask.repeat_interleave(self.gqa_ratio, dim=1).unsqueeze(1)
        return _Group(
            rows=None if rows is None else rows.to(device),
            pad_index=None if pad_index is None else pad_index.to(device),
            pages=batch.page_table[reqs.to(device), :num_pages].long(),
            mask=mask.to(device),
            num_reqs=int(reqs.numel()),
            q_len=q_len,
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
            out[g.rows] = self._attend(g, q[g.rows], k_pages, v_pages)
        return out

    def _attend(self, g: _Group, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """Attention for one group; q holds the group's tokens `[n, H, D]` in request order."""
        n, heads, dim = q.shape
        kv, ratio = self.num_kv_heads, self.gqa_ratio
        if g.pad_index is not None:
            padded = q.new_zeros(g.num_reqs * g.q_len, heads, dim)
            padded[g.pad_index] = q
            q = padded
        # [G, q_len, KV, ratio, D] -> [G, KV, q_len * ratio, D]: heads sharing a KV head become extra queries.
        q = q.view(g.num_reqs, g.q_len, kv, ratio, dim).permute(0, 2, 1, 3, 4).reshape(g.num_reqs, kv, g.q_len * ratio, dim)
        keys = k_pages[g.pages].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [G, KV, P * page_size, D]
        values = v_pages[g.pages].flatten(1, 2).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=g.mask, scale=self.scale)
        o = o.view(g.num_reqs, kv, g.q_len, ratio, dim).permute(0, 2, 1, 3, 4).reshape(g.num_reqs * g.q_len, heads, dim)
        return o if g.pad_index is None else o[g.pad_index]
