"""What a grammar may cost, checked before its request is queued (issue 33).

llguidance accepts some valid grammars that its parser then gives up on at the first token: an alternation of
20,000 strings, a right recursion over 2,000 alternatives, a JSON schema that is `anyOf` 3,000 objects all fill one
Earley row past `max_items_in_row`. Nothing in the grammar's text says so cheaply, so the check runs the grammar:
build its matcher under `LIMITS`, compute its first mask, then walk a few of the tokens that mask allows a couple of
steps deep on copies. A limit hit anywhere is a ParamError naming the field, and so is a build that took longer
than its budget; the matcher that passed is the template every request of that grammar copies (its first mask is
computed already). A grammar that passes and still fails deeper ends its request with a GrammarFailedError.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import llguidance
import numpy as np

from radixserve.errors import ParamError
from radixserve.log_bounds import clip

# llguidance's defaults, named here because they are the contract: a row of at most 2,000 Earley items, at most
# 50,000 items and 200,000 lexer fuel per mask (~15 ms at the speeds its docs give), 1,000,000 fuel to build the
# lexer. verbose_errors=False: an error states the limit and never quotes the grammar or the parser's state (with
# it on, one failure's message held the whole grammar, ~300 KB).
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    step_max_items=50_000,
    step_lexer_fuel=200_000,
    initial_lexer_fuel=1_000_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    verbose_errors=False,
)
COMPILE_BUDGET_S = 2.0  # building the matcher, its first mask and the probes; past it the grammar is refused
PROBE_BREADTH = 8  # first tokens tried (spread over the allowed ids)
PROBE_DEPTH = 2  # tokens consumed along each
# A step's masks are computed on a side thread while the forward runs, and the step waits for the slowest, so a
# grammar whose masks cost more than this would slow every request batched with it (a counted regex over 125,000
# characters: 25-75 ms a mask with a 150k vocabulary). Measured on the probes in CPU time (a busy machine pre-empting
# the thread does not count); past it the grammar is refused.
MASK_BUDGET_S = 0.01
# Jump-forward computes a grammar's forced tokens on the engine loop's thread after each sampled token: a grammar
# whose probes took longer than this for it (a counted regex forcing 100,000 characters: ~50 ms) samples every token
# instead, with its mask computed on the side thread like any other.
FORCED_BUDGET_S = 0.005


class _Probe:
    """The check of one grammar: its time budget, and the costliest mask and forced run met so far (CPU time)."""

    def __init__(self, field: str, seconds: float) -> None:
        self.field = field
        self.seconds = seconds
        self.start = time.perf_counter()
        self.mask_s = 0.0
        self.forced_s = 0.0

    def check(self, m: llguidance.LLMatcher) -> None:
        """ParamError if the matcher hit a limit or the budget ran out."""
        if m.is_error():
            raise too_complex(self.field, m.get_error())
        spent = time.perf_counter() - self.start
        if spent > self.seconds:
            raise ParamError(
                self.field,
                f"{self.field} took {spent:.1f} s to prepare, over the budget of {self.seconds:.1f} s",
                code="grammar_too_complex",
            )

    def mask(self, m: llguidance.LLMatcher) -> bytes:
        start = time.thread_time()
        mask = m.compute_bitmask()
        self.mask_s = max(self.mask_s, time.thread_time() - start)
        self.check(m)
        return mask

    def forced(self, m: llguidance.LLMatcher) -> None:
        start = time.thread_time()
        m.compute_ff_tokens()
        self.forced_s = max(self.forced_s, time.thread_time() - start)
        self.check(m)


def too_complex(field: str, error: str) -> ParamError:
    return ParamError(field, f"{field} is too complex: {reason(error)}", code="grammar_too_complex")


def reason(error: str) -> str:
    """llguidance's error message, bounded, without its marker for the detail it leaves out."""
    return clip(error.replace("<non-verbose/>", "").strip())


@dataclass(frozen=True, eq=False)
class Checked:
    """A grammar that passed: its matcher at the start, the first mask (every request of the grammar starts with
    it, so no step computes it again), and whether its forced runs are cheap enough for jump-forward."""

    matcher: llguidance.LLMatcher
    first_mask: bytes
    jump_forward: bool


def checked_matcher(
    tokenizer: llguidance.LLTokenizer, text: str, field: str, eos: Collection[int], budget_s: float = COMPILE_BUDGET_S
) -> Checked:
    """The grammar's matcher and first mask, once the probes found no limit it goes past (ParamError otherwise)."""
    check = _Probe(field, budget_s)
    m = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
    if m.is_error():
        raise ParamError(field, f"invalid {field}: {reason(m.get_error())}")
    first_mask = m.compute_bitmask()  # computed once here, then copied: its cost is the check's, not a step's
    check.check(m)
    for tok in _spread(_allowed(first_mask, tokenizer.vocab_size, eos), PROBE_BREADTH):
        _walk(m, int(tok), check, tokenizer.vocab_size, eos)
    if check.mask_s > MASK_BUDGET_S:
        raise ParamError(
            field,
            f"{field} is too costly: a token mask took {check.mask_s * 1000:.0f} ms to compute, over the budget of "
            f"{MASK_BUDGET_S * 1000:.0f} ms a step",
            code="grammar_too_complex",
        )
    return Checked(m, first_mask, check.forced_s <= FORCED_BUDGET_S)


def _walk(m: llguidance.LLMatcher, tok: int, check: _Probe, vocab: int, eos: Collection[int]) -> None:
    """Walk a copy of `m` from `tok` PROBE_DEPTH tokens deep (each next token from the middle of what its mask
    allows), as a request would: consume, then its forced tokens and its next mask, each timed."""
    probe = m.deep_copy()
    for _ in range(PROBE_DEPTH):
        probe.consume_token(tok)
        check.check(probe)
        if probe.is_stopped():
            break
        check.forced(probe.deep_copy())  # on a copy: each computation pays for the lexer states it needs, as a step
        after = _allowed(check.mask(probe), vocab, eos)
        if not len(after):
            break
        tok = int(after[len(after) // 2])


def _allowed(mask: bytes, vocab: int, eos: Collection[int]) -> np.ndarray:
    """The ids a mask allows, end of sequence left out (it ends the walk rather than testing the grammar)."""
    ids = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab])
    return ids[~np.isin(ids, list(eos))] if eos else ids


def _spread(ids: np.ndarray, n: int) -> np.ndarray:
    if len(ids) <= n:
        return ids
    return ids[np.linspace(0, len(ids) - 1, n).astype(np.int64)]
