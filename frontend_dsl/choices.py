"""How `select` turns per-choice token logprobs into a decision: SGLang's three selection methods, same call shape.

A method is called with keyword arguments (choices, normalized_prompt_logprobs, input_token_logprobs,
output_token_logprobs, unconditional_token_logprobs) and returns a ChoicesDecision whose meta_info is what
`state.get_meta_info(name)` gives back. Token logprob entries are (logprob, token_id, token_text) tuples, as SGLang
reports them; a user-written subclass of ChoicesSamplingMethod plugs in the same way.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Entries = list[list[tuple[Any, ...]]]  # per choice, per token: (logprob, token_id, token_text)


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _logprobs(entries: list[tuple[Any, ...]]) -> list[float]:
    """The entries' logprobs; a token with no context (the first of a select with no text before it) counts as 0."""
    return [0.0 if e[0] is None else float(e[0]) for e in entries]


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        """True: the backend also scores each choice with no prompt before it (costs one more batched call)."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: Entries | None = None,
    ) -> ChoicesDecision: ...


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob over its own tokens (ties: the earliest)."""

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: Entries | None = None,
    ) -> ChoicesDecision:
        return ChoicesDecision(
            choices[_argmax_first(normalized_prompt_logprobs)],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best logprob at each position until one is left; a
    choice shorter than the others is padded with its own mean logprob (so a prefix of a longer choice competes)."""

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: Entries | None = None,
    ) -> ChoicesDecision:
        width = max(len(e) for e in input_token_logprobs)
        matrix = []
        for entries in input_token_logprobs:
            lps = _logprobs(entries)
            pad = sum(lps) / len(lps) if lps else -math.inf
            matrix.append(lps + [pad] * (width - len(lps)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            choices[remaining[0]],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most, on average, from the prompt: mean of (logprob after the prompt -
    logprob with no prompt). With no prompt the first token has no logprob; it counts as 0 (see _logprobs)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: Entries | None = None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token logprobs differ in length")
            diffs = [c - u for c, u in zip(_logprobs(cond), _logprobs(uncond))]
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        return ChoicesDecision(
            choices[_argmax_first(scores)],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
