"""The packed input of one model forward: prefill chunks and decode tokens of many requests at once."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from radixserve.transfer import to_device


@dataclass
class ForwardBatch:
    """Request i contributes `extend_lens[i]` new tokens after `prefix_lens[i]` tokens already in the KV pool.

    Tokens are packed request after request: request i owns rows qo_indptr[i]:qo_indptr[i+1] of
    `input_ids`/`positions`/`out_cache_loc`. A decode token is an extend of length 1.
    `page_table[i, j]` is the pool page holding tokens j*page_size .. (j+1)*page_size-1 of request i,
    covering all `seq_lens[i] = prefix_lens[i] + extend_lens[i]` tokens (padding entries are 0, the sink page).
    `out_cache_loc[t]` = page * page_size + offset: the slot where token t's K/V is written.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    prefix_lens: torch.Tensor  # [B] int32, on CPU
    extend_lens: torch.Tensor  # [B] int32, on CPU
    seq_lens: torch.Tensor  # [B] int32, on CPU
    qo_indptr: torch.Tensor  # [B+1] int32, on CPU
    page_table: torch.Tensor  # [B, max_pages] int32
    page_size: int
    logits_indices: torch.Tensor  # [N] int64: rows of the packed batch whose logits are wanted

    @property
    def batch_size(self) -> int:
        return int(self.extend_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        """True when every request adds exactly one token (a pure decode step)."""
        return self.num_tokens == self.batch_size

    def to(self, device: torch.device) -> "ForwardBatch":
        """This batch with its device-side tensors (ids, positions, slots, page table, logits rows) on `device`.

        On CUDA they go through pinned memory with non-blocking copies: the caller's thread never waits for kernels
        already queued (the step in flight), and the copies run in stream order before this step's kernels.
        """
        return replace(
            self,
            input_ids=to_device(self.input_ids, device),
            positions=to_device(self.positions, device),
            out_cache_loc=to_device(self.out_cache_loc, device),
            page_table=to_device(self.page_table, device),
            logits_indices=to_device(self.logits_indices, device),
        )

    @staticmethod
    def build(
        token_chunks: list[list[int]],
        prefix_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        logits_rows: list[int],
        device: torch.device | str = "cpu",
        page_table: torch.Tensor | None = None,
    ) -> "ForwardBatch":
        """Pack per-request new tokens, their KV offsets and page tables into tensors.

        `page_tables[i]` must cover prefix_lens[i] + len(token_chunks[i]) tokens; `logits_rows` index the packed rows.
        `page_table`, if given, is those lists already padded into one int32 tensor (the scheduler keeps it across
        steps, see scheduler/page_rows.py); otherwise it is built from them.
        """
        extend = [len(c) for c in token_chunks]
        seq = [p + e for p, e in zip(prefix_lens, extend)]
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        for i, (chunk, p, pt) in enumerate(zip(token_chunks, prefix_lens, page_tables)):
            if len(pt) * page_size < seq[i]:
                raise ValueError(f"page table of request {i} covers {len(pt) * page_size} tokens, needs {seq[i]}")
            ids.extend(chunk)
            for t in range(p, p + len(chunk)):
                pos.append(t)
                loc.append(pt[t // page_size] * page_size + t % page_size)
        # one tensor from Python's running sum: torch's zeros, cumsum and slice copy took 9 us against 3 (one request)
        indptr = torch.tensor(list(itertools.accumulate(extend, initial=0)), dtype=torch.int32)
        if page_table is None:
            # one tensor from padded rows: a tensor per row cost more than the rest of the build
            max_pages = max((len(pt) for pt in page_tables), default=1) or 1
            rows = [list(pt) + [0] * (max_pages - len(pt)) for pt in page_tables]
            page_table = torch.tensor(rows, dtype=torch.int32).reshape(len(page_tables), max_pages)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            out_cache_loc=torch.tensor(loc, dtype=torch.int64, device=device),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            extend_lens=torch.tensor(extend, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            qo_indptr=indptr,
            page_table=page_table.to(device),
            page_size=page_size,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        )
