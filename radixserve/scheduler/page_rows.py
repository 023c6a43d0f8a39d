"""Each running request's page table kept across steps, one row per runner slot, written only where it changed.

A step's page table used to be built from every request's whole page list, which costs O(pages held) per step:
at batch 256 with 1,600-token contexts, about 1 ms of the loop thread each step. Here a request's pages are a
`PageList` that remembers the first position changed since its row was last copied, so a decode step writes
only the rows that gained a page (one request in `page_size`) and gathers the step's rows in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixserve.page_list import CLEAN, PageList


class PageRows:
    """Row `slot` holds the pages of the request running in that slot, zero past them (page 0 is the sink)."""

    def __init__(self, num_slots: int, width: int = 64) -> None:
        self.table = np.zeros((num_slots, width), dtype=np.int32)
        self.lens = [0] * num_slots
        # The list each row was last copied from: a row whose slot changed hands is copied whole.
        self.source: list[PageList | None] = [None] * num_slots

    def gather(self, slots: Sequence[int], pages: Sequence[PageList]) -> torch.Tensor:
        """The page table of one step: `[len(slots), max pages]` int32, a copy (the rows change under later steps)."""
        width = max((len(p) for p in pages), default=1) or 1
        if width > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(width, 2 * self.table.shape[1])), dtype=np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        for slot, p in zip(slots, pages):
            self._sync(slot, p)
        return torch.from_numpy(self.table[np.asarray(slots, dtype=np.int64), :width])

    def _sync(self, slot: int, pages: PageList) -> None:
        # Only the changed tail is copied if this row holds this list's last copy (neither moved since).
        start = pages.changed_from if self.source[slot] is pages and pages.row == slot else 0
        n, before = len(pages), self.lens[slot]
        if start < n:
            self.table[slot, start:n] = pages[start:]
        if n < before:
            self.table[slot, n:before] = 0
        self.lens[slot], self.source[slot] = n, pages
        pages.changed_from, pages.row = CLEAN, slot
