"""What the sampler needs of one request: its settings, its RNG, and the tokens its penalties look at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.sampling_params import SamplingParams
from radixserve.transfer import to_device


@dataclass
class SamplingInfo:
    """One row of a batch: its settings, RNG, and the tokens the penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None  # per request, seeded from params.seed; None draws from torch's global RNG
    output_ids: Sequence[int]  # generated so far (frequency/presence and repetition penalties)
    prompt_ids: Sequence[int]  # repetition penalty also covers the prompt (HF semantics)
    top_logprobs_num: int = 0
    return_logprob: bool = False
    token_ids_logprob: tuple[int, ...] = ()  # ids whose logprobs follow the top ones in each row's top list
    stop_ids: frozenset[int] = frozenset()  # the ids that end it (EOS unless ignored, stop_token_ids): banned while
    # fewer than min_new_tokens are out
    seen: SeenIds | None = None  # the repetition penalty's ids, kept across steps (None: built from the lists)
    drafts: int = 0  # a verify row's drafts at the end of output_ids: penalised as output, never kept in `seen`

    @property
    def banned_ids(self) -> frozenset[int]:
        """Ids the row may not sample now: its stop ids while it is short of min_new_tokens."""
        return self.stop_ids if len(self.output_ids) < self.params.min_new_tokens else frozenset()


class SeenIds:
    """The distinct ids of a request's prompt and output, as the index tensor the repetition penalty reads.

    Kept on the request and grown by the ids output since the last step: rebuilding the set and the index every
    step cost O(prompt + output) per token (0.31 ms a step at a 2,000-token prompt, 3.9 ms at eight such rows:
    benchmarks/penalty_cost.py, RESULTS.md issue 38 session 17).
    `output_ids` must only grow (a request's live list does), but for the drafts at its end that a verify row counts
    as output: those are added to that row's ids and never kept.
    """

    def __init__(self, prompt_ids: Sequence[int]):
        self._set = set(prompt_ids)
        # The distinct ids in a numpy buffer grown in place: per step a row adds an id or none, and a torch.tensor
        # plus a torch.cat for it, with the vocabulary filter, cost ~15 us a row (RESULTS.md, issue 38 session 48).
        self._buf = np.fromiter(self._set, dtype=np.int64, count=len(self._set))
        self._n = len(self._set)
        self._folded = 0  # how many output ids are in the set
        self._max = max(self._set, default=-1)
        self._on_device = torch.empty(0, dtype=torch.long)  # off the CPU: the first ids, copied there once

    def ids(self, output_ids: Sequence[int], vocab: int, device: torch.device, drafts: int = 0) -> torch.Tensor:
        """The distinct ids of prompt + output_ids that are in 0..vocab-1, on device; the last `drafts` of
        output_ids are counted for this call only."""
        kept = len(output_ids) - drafts
        for t in output_ids[self._folded : kept]:
            if t not in self._set:
                self._set.add(t)
                self._append(t)
        self._folded = kept
        unseen = sorted({t for t in output_ids[kept:] if t not in self._set and 0 <= t < vocab})
        ids = self._on(device)
        if self._max >= vocab:
            ids = ids[(ids >= 0) & (ids < vocab)]
        if not unseen:
            return ids
        return torch.cat([ids, to_device(torch.tensor(unseen, dtype=torch.long), device)])

    def _append(self, t: int) -> None:
        if self._n == len(self._buf):
            self._buf = np.resize(self._buf, max(16, 2 * self._n))
        self._buf[self._n] = t
        self._n += 1
        self._max = max(self._max, t)

    def _on(self, device: torch.device) -> torch.Tensor:
        """The ids so far on device: a view of the buffer on the CPU, else the device copy grown by the new ones."""
        if device.type == "cpu":
            return torch.from_numpy(self._buf[: self._n])
        have = len(self._on_device) if self._on_device.device == device else 0
        if have < self._n:
            new = to_device(torch.from_numpy(self._buf[have : self._n].copy()), device)
            self._on_device = torch.cat([self._on_device, new]) if have else new
        return self._on_device
