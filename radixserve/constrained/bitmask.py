"""One step's token bitmasks: filled for every constrained row of the batch, then applied to the logits before
sampling. Filling runs on a side thread started before the forward (llguidance drops the GIL while it computes),
so the mask is usually ready when the logits are; applying it waits for it."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from radixserve.constrained.grammar import GrammarMatcher

_FILLER = ThreadPoolExecutor(1, thread_name_prefix="radixserve-bitmask")
_EXECUTOR = llguidance.LLExecutor(num_threads=2)  # several rows' masks in parallel (Rust threads, no GIL)
_SHIFTS = torch.arange(32, dtype=torch.int32)


class StepMasks:
    """The constrained rows of one step: `rows[i]` is the sampled row (index into the step's sampled logits) whose
    next token `matchers[i]` constrains."""

    def __init__(self, rows: list[int], matchers: list[GrammarMatcher]) -> None:
        self.rows = rows
        self.matchers = matchers
        vocab = matchers[0].vocab_size
        self.bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
        self._lock = threading.Lock()
        self._future: Future[None] | None = None

    def start(self) -> None:
        """Begin filling on the side thread (idempotent); `apply` waits for it."""
        with self._lock:
            if self._future is None:
                self._future = _FILLER.submit(self._fill)

    def _fill(self) -> None:
        # llguidance.torch's fill_next_token_bitmask(_par) are these calls plus checks that hold by construction
        # (self.bitmask: CPU, int32, contiguous); importing that module costs ~2-4 s of start-up, since it
        # decorates an unrelated function with torch.compile at import time, which loads torch._dynamo.
        # A request's first mask is its grammar's, known from the check made before it was queued: copied.
        row_bytes = self.bitmask.shape[1] * self.bitmask.element_size()
        pairs = []
        for i, m in enumerate(self.matchers):
            if m.first_mask is not None:
                self._copy(i, m.first_mask)
            else:
                pairs.append((m.ll, i))
        if len(pairs) == 1:
            ptr = self.bitmask.data_ptr() + pairs[0][1] * row_bytes
            pairs[0][0].unsafe_compute_mask_ptr(ptr, row_bytes)
        elif pairs:
            _EXECUTOR.unsafe_compute_mask_ptr(pairs, self.bitmask.data_ptr(), row_bytes, len(self.matchers))

    def _copy(self, row: int, mask: bytes) -> None:
        # llguidance's mask may hold a word more than the rows here (its vocabulary counts one more id): cut to fit.
        words = torch.frombuffer(bytearray(mask), dtype=torch.int32)[: self.bitmask.shape[1]]
        self.bitmask[row].zero_()
        self.bitmask[row, : len(words)] = words

    def apply(self, logits: torch.Tensor, at: list[int] | None = None) -> None:
        """Set every id the grammar refuses to -inf in the constrained rows of logits [R, V] (in place): rows
        `self.rows` (one per sampled request), or `at` where the logits hold more rows than that (a verify step)."""
        self.start()
        assert self._future is not None
        self._future.result()
        allowed = unpack(self.bitmask, logits.shape[1]).to(logits.device, non_blocking=True)
        rows = torch.tensor(self.rows if at is None else at, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 words (bit j of word w: id 32w + j allowed) -> [N, vocab] bool; ids past the words refused."""
    bits = ((bitmask[:, :, None] >> _SHIFTS) & 1).bool().view(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bitmask.shape[0], vocab - bits.shape[1], dtype=torch.bool)
    return torch.cat([bits, pad], dim=1)
