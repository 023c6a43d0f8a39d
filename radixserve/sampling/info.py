"""What the sampler needs of one request: its settings, its RNG, and the tokens its penalties look at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        self._new = list(self._set)  # distinct ids not yet in the tensor
        self._folded = 0  # how many output ids are in the set
        self._ids = torch.empty(0, dtype=torch.long)
        self._max = -1

    def ids(self, output_ids: Sequence[int], vocab: int, device: torch.device, drafts: int = 0) -> torch.Tensor:
        """The distinct ids of prompt + output_ids that are in 0..vocab-1, on device; the last `drafts` of
        output_ids are counted for this call only."""
        kept = len(output_ids) - drafts
        for t in output_ids[self._folded : kept]:
            if t not in self._set:
                self._set.add(t)
                self._new.append(t)
        self._folded = kept
        if self._new:
            self._max = max(self._max, max(self._new))
            self._ids = torch.cat([self._ids, to_device(torch.tensor(self._new, dtype=torch.long), self._ids.device)])
            self._new = []
        self._ids = to_device(self._ids, device)
        ids = self._ids if self._max < vocab else self._ids[(self._ids >= 0) & (self._ids < vocab)]
        unseen = {t for t in output_ids[kept:] if t not in self._set and 0 <= t < vocab}
        return torch.cat([ids, to_device(torch.tensor(sorted(unseen), dtype=torch.long), device)]) if unseen else ids
