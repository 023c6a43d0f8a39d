"""What the sampler needs of one request: its settings, its RNG, and the tokens its penalties look at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.sampling_params import SamplingParams


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

    @property
    def banned_ids(self) -> frozenset[int]:
        """Ids the row may not sample now: its stop ids while it is short of min_new_tokens."""
        return self.stop_ids if len(self.output_ids) < self.params.min_new_tokens else frozenset()
