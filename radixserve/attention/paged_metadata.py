"""FlashInfer-style paged-KV metadata (CSR indptrs, page indices, last-page lengths) built from a ForwardBatch.

Request i's keys are the `seq_lens[i]` tokens held by pages `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, in order;
every page is full except the last, which holds `kv_last_page_len[i]` tokens (1..page_size). Its queries are rows
`qo_indptr[i]:qo_indptr[i+1]` of the packed batch, the last `extend_lens[i]` positions of its keys (causal mask
aligned to the end of the keys). Pure PyTorch, no CUDA needed: the indptrs stay on the CPU (FlashInfer plans on
the host) and `kv_indices` is gathered on the page table's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch
from radixserve.transfer import pinned, to_device


@dataclass(frozen=True)
class PagedKVMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32, CPU
    kv_indptr: torch.Tensor  # [B+1] int32, CPU
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the page table's device
    kv_last_page_len: torch.Tensor  # [B] int32, CPU
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.numel())


def num_kv_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages needed to hold `seq_lens` `[B]` tokens each -> `[B]` int64 (ceil division)."""
    return (seq_lens.long() + page_size - 1) // page_size


def kv_indptr(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[B+1]` int32 prefix sum of each request's page count; request i owns kv_indices[ptr[i]:ptr[i+1]]."""
    ptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(num_kv_pages(seq_lens.cpu(), page_size), 0)
    return ptr.to(torch.int32)


def kv_last_page_len(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[B]` int32 tokens in each request's last page: in 1..page_size for seq_len > 0, and 0 for an empty request."""
    lens = seq_lens.cpu().long()
    return torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens)).to(torch.int32)


def kv_indices(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The first ceil(seq_lens[i] / page_size) entries of each page-table row, concatenated -> int32 on its device.

    One index_select with indices computed on the CPU: no boolean mask, so no device-to-host sync on a GPU.
    """
    rows, width = page_table.shape
    counts = num_kv_pages(seq_lens.cpu(), page_size)
    if bool((counts > width).any()):
        raise ValueError(f"page table has {width} pages per request, a request needs {int(counts.max())}")
    offsets = torch.cumsum(counts, 0) - counts
    flat = torch.repeat_interleave(torch.arange(rows) * width - offsets, counts) + torch.arange(int(counts.sum()))
    return page_table.reshape(-1).index_select(0, to_device(flat, page_table.device)).to(torch.int32)


def build_paged_metadata(batch: ForwardBatch) -> PagedKVMetadata:
    """Metadata of every request's whole KV (prefix + this step's new tokens) and its query rows."""
    ps = batch.page_size
    # FlashInfer copies the host indptrs into its device buffers without blocking: pinned, so that it can.
    return PagedKVMetadata(
        qo_indptr=pinned(batch.qo_indptr.cpu().to(torch.int32)),
        kv_indptr=pinned(kv_indptr(batch.seq_lens, ps)),
        kv_indices=kv_indices(batch.page_table, batch.seq_lens, ps),
        kv_last_page_len=pinned(kv_last_page_len(batch.seq_lens, ps)),
        page_size=ps,
    )
