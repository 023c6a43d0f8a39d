"""The prompts and answers deterministic mode's tests compare (tests/test_deterministic*.py): a target prompt with a
repeated passage (so the n-gram drafter has drafts), other prompts of mixed lengths, and each prompt's greedy and
seeded tokens with their logprobs."""

from __future__ import annotations

import random
from typing import Any

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True}
DEFAULTS = dict(dtype="auto", quantization="auto", max_total_tokens=12288, max_running_requests=64)
Answer = tuple[list[int], list[float]]


def target_prompt() -> list[int]:
    """150 tokens (9 pages of 16 and 6 more) with a repeated passage, so the n-gram drafter has drafts to verify."""
    rng = random.Random(5)
    passage = [rng.randrange(3, 500) for _ in range(40)]
    return [rng.randrange(3, 500) for _ in range(30)] + passage + [rng.randrange(3, 500) for _ in range(40)] + passage


def others(count: int) -> list[list[int]]:
    """`count` other prompts of mixed lengths (3 to ~200 tokens)."""
    rng = random.Random(count)
    return [[rng.randrange(3, 500) for _ in range(rng.choice((3, 9, 17, 40, 77, 130, 201)))] for _ in range(count)]


def answers(eng: Any, prompts: list[list[int]], params: dict[str, Any]) -> list[Answer]:
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    outs = outs if isinstance(outs, list) else [outs]
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def target_answers(eng: Any, batch: list[list[int]], at: int) -> tuple[Answer, Answer]:
    """The target's greedy and seeded answers when it sits at index `at` of `batch` (the rest greedy / seeded too)."""
    prompts = batch[:at] + [target_prompt()] + batch[at:]
    return answers(eng, prompts, GREEDY)[at], answers(eng, prompts, SEEDED)[at]
