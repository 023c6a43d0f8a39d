"""The drafter: per running request, up to k guessed next tokens from the better of two sources (its own tokens, the
radix tree), with k adapted to the request's recent acceptance, and counts of what was proposed and accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.request import Req
from radixserve.speculative.gate import CostGate
from radixserve.speculative.prompt_lookup import PromptLookup
from radixserve.step import Draft

SOURCES = ("prompt", "tree")
FIRST_K = 4  # draft length a request starts with (grows while every draft is accepted)
MIN_RATE = 0.2  # below this recent acceptance rate a verify row costs more than it returns: pause drafting
PAUSE_STEPS = 16  # decode steps without drafts after the rate fell below MIN_RATE, then probe again with k = 1
RATE_DECAY = 0.7  # weight of the past in the acceptance-rate average


@dataclass
class DraftState:
    """A request's drafting state, kept across its steps (and retractions)."""

    lookup: PromptLookup
    k: int
    rate: float = 1.0  # moving average of accepted / proposed
    pause: int = 0  # decode steps left without drafts


@dataclass
class SpecStats:
    proposed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    verify_steps: int = 0  # request-steps that verified a draft
    accepted_hist: list[int] = field(default_factory=list)  # [j]: request-steps that accepted j drafts

    def mean_accepted_length(self) -> float:
        """Tokens a verify step produced per request on average: accepted drafts plus the model's own token."""
        accepted = sum(self.accepted.values())
        return (accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Drafter:
    def __init__(
        self,
        max_tokens: int,
        vocab_size: int,
        index: ContinuationIndex | None,
        max_batch: int | None = None,
        gate: CostGate | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.index = index
        self.max_batch = max_batch  # no drafts in steps with more decodes than this (None: no limit)
        self.gate = gate  # drafts only while verify steps are measured to pay (None: always)
        self.stats = SpecStats(accepted_hist=[0] * (max_tokens + 1))

    def drafting(self, decodes: list[Req], pure: bool) -> list[Req]:
        """The decodes that draft this step (`pure`: the step holds no prefill chunk): none in a step with a prefill
        chunk (its verify rows would delay that chunk's first token by their compute), nor in one with more decodes
        than max_batch (a verify row then costs compute), nor where the gate measured that drafting does not pay at
        this many decodes; else those that may."""
        allowed = self.gate is None or self.gate.begin([id(r) for r in decodes], pure)
        if not allowed or not pure or (self.max_batch is not None and len(decodes) > self.max_batch):
            return []
        return [r for r in decodes if self.may_draft(r)]

    @staticmethod
    def may_draft(req: Req) -> bool:
        """Whether this request may draft. Seeded sampled requests never do: their seed must give the tokens it
        gives without speculation (a verify step draws differently), so they decode plainly; nor do constrained
        ones."""
        p = req.params
        if req.inflight_tokens or req.next_prompt_logprob_pos >= 0:
            return False  # the last token is still being sampled, or prompt logprobs are owed
        if req.grammar is not None:
            return False  # a grammar masks one row per request and accepts tokens one by one (jump-forward instead)
        if p.logit_bias or len(req.output_ids) < p.min_new_tokens or req.sampling.token_ids_logprob:
            return False  # verify scores drafts without the bias rules and reports only top logprobs
        return p.is_greedy or p.seed is None

    def propose(self, req: Req, room: int) -> Draft | None:
        """At most `room` tokens from the source with the longer match, or None (nothing matched, or paused)."""
        state = req.draft_state
        if state is None:
            state = req.draft_state = DraftState(PromptLookup(), min(FIRST_K, self.max_tokens))
        k = min(state.k, room)
        n_prompt, tokens = state.lookup.propose(req.fill_ids, k)  # indexes new tokens even while paused
        if state.pause > 0:
            state.pause -= 1
            return None
        if k <= 0:
            return None
        draft = Draft(tokens, "prompt") if tokens else None
        if self.index is not None:
            tree = self.index.lookup(req.namespace, req.fill_ids, k)
            if tree is not None and (tree.match, len(tree.tokens)) > (n_prompt, len(tokens)):
                draft = Draft(tree.tokens, "tree")
        if draft is None:
            return None
        for i, tok in enumerate(draft.tokens):
            if not 0 <= tok < self.vocab_size:  # a tokenizer id the model's head cannot produce
                draft.tokens = draft.tokens[:i]
                break
        return draft if draft.tokens else None

    def record(self, req: Req, draft: Draft, accepted: int) -> None:
        """Adapt the request's k to how much of its draft was accepted; count it."""
        s = self.stats
        s.proposed[draft.source] += len(draft.tokens)
        s.accepted[draft.source] += accepted
        s.verify_steps += 1
        s.accepted_hist[min(accepted, self.max_tokens)] += 1
        if self.gate is not None:
            self.gate.verified(accepted)
        state = req.draft_state
        if state is None:
            return
        proposed = len(draft.tokens)
        state.rate = RATE_DECAY * state.rate + (1 - RATE_DECAY) * accepted / proposed
        state.k = min(self.max_tokens, 2 * state.k) if accepted == proposed else max(1, accepted + 1)
        if state.rate < MIN_RATE:
            state.pause, state.k, state.rate = PAUSE_STEPS, 1, 2 * MIN_RATE


def spec_stats(drafter: Drafter | None) -> dict[str, Any]:
    """Speculative decoding's counts for cache_stats(): draft tokens proposed and accepted per source, accepted
    length per step."""
    if drafter is None:
        return {"spec_enabled": False}
    s = drafter.stats
    return {
        "spec_enabled": True,
        "spec_draft_tokens": dict(s.proposed),
        "spec_accepted_tokens": dict(s.accepted),
        "spec_verify_steps": s.verify_steps,
        "spec_accept_rate": sum(s.accepted.values()) / max(sum(s.proposed.values()), 1),
        "spec_mean_accepted_length": s.mean_accepted_length(),
        "spec_accepted_length_hist": list(s.accepted_hist),
    }
