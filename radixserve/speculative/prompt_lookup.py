"""Prompt lookup: the longest recent n-gram at the end of a request's tokens found earlier in them (its prompt or
its output), and the tokens that followed it there."""

from __future__ import annotations

from collections.abc import Sequence

MIN_GRAM = 2  # a single repeated token predicts too little to pay for a verify row
MAX_GRAM = 8
MAX_MATCH = 16  # a match of MAX_GRAM is measured further back, up to this (comparable with the tree's matches)


class PromptLookup:
    """One request's n-grams (MIN_GRAM..MAX_GRAM tokens) -> the position just after their latest occurrence.

    Built incrementally: the request's tokens only ever grow (a retracted request keeps them), so each call indexes
    only what was added since the last one."""

    def __init__(self) -> None:
        self._index: dict[tuple[int, ...], int] = {}
        self._next_end = 1  # n-grams ending before this position are indexed

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(match length, up to k tokens that followed the longest matched suffix), or (0, []) without a match."""
        length = len(tokens)
        index = self._index
        # Grams ending at `end` (exclusive) with at least one token after them, i.e. end < length.
        for end in range(self._next_end, length):
            for n in range(MIN_GRAM, min(MAX_GRAM, end) + 1):
                index[tuple(tokens[end - n : end])] = end
        self._next_end = max(self._next_end, length)
        if k <= 0:
            return 0, []
        for n in range(min(MAX_GRAM, length - 1), MIN_GRAM - 1, -1):
            end = index.get(tuple(tokens[length - n :]))
            if end is not None:
                if n == MAX_GRAM:  # measured further back, without indexing longer grams
                    while n < min(MAX_MATCH, end) and tokens[end - n - 1] == tokens[length - n - 1]:
                        n += 1
                # Past the end of the tokens the continuation repeats with the period the match shows (end is
                # within `length`, so a run like "a b a b" drafts "a b a b ..." rather than stopping short).
                out: list[int] = []
                for i in range(k):
                    pos = end + i
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return n, out
        return 0, []
