"""How `select` turns per-choice token logprobs into a decision."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ChoicesDecision:
    index: int
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod(Protocol):
    def __call__(self, choices: list[str], token_logprobs: list[list[float]]) -> ChoicesDecision: ...


def token_length_normalized(choices: list[str], token_logprobs: list[list[float]]) -> ChoicesDecision:
    """Pick the choice with the highest mean logprob over its own tokens (ties: the earliest choice)."""
    scores = [sum(lps) / len(lps) if lps else -math.inf for lps in token_logprobs]
    best = max(range(len(choices)), key=lambda i: (scores[i], -i))
    return ChoicesDecision(best, {"normalized_prompt_logprobs": scores, "token_logprobs": token_logprobs})
