"""One scheduled step: what the model computes and samples, and what comes back. The types between the scheduler
and the model runner, below both (the runner imports nothing of the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.constrained.bitmask import StepMasks
from radixserve.forward_batch import ForwardBatch
from radixserve.request import Req
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling.speculative import DraftRun


@dataclass
class Draft:
    """Guessed next tokens of one request, verified by its step (radixserve/speculative/)."""

    tokens: list[int]
    source: str  # "prompt" (its own tokens) or "tree" (the radix tree's sequences)


@dataclass
class ScheduledBatch:
    """Request i runs `chunks[i]` tokens from the kv_len it had when scheduled.

    A request with a draft runs `1 + len(draft.tokens)` tokens (its last token, then the draft) and its sampled row
    is the first of as many consecutive logits rows (see radixserve/sampling/speculative.py).

    A decode input whose token is still being sampled by the previous step appears in `forward.input_ids` as
    `-(slot + 1)`; the runner swaps in the id that step wrote to its slot (see ModelRunner.execute).
    """

    reqs: list[Req]
    chunks: list[int]
    forward: ForwardBatch
    sample_rows: list[int | None]  # per request: logits row to sample from (None: mid-prefill or prefill-only)
    prompt_rows: list[tuple[int, int, int] | None]  # per request: (first logits row, count, first prompt position)
    sample_infos: list[SamplingInfo]  # one per sampled request, in request order
    sample_slots: list[int]  # the slot each sampled token is written to, for the next step's placeholders
    # per request with prompt rows: (prompt tokens scored, top-k wanted, token_ids_logprob)
    prompt_targets: list[tuple[list[int], int, tuple[int, ...]]]
    has_placeholders: bool = False  # some input ids are slots of tokens still being sampled
    needs_sync: bool = False  # a sampled request reads its own output history (penalties): it must be current
    # Partial-page reuse: before the forward, the pool's K/V rows at flat slots copy_src are copied to copy_dst (all
    # read before any is written); copied[i] of them are request i's, which its kv_len already counts.
    copied: list[int] = field(default_factory=list)
    copy_src: torch.Tensor | None = None  # [R] int64 flat slots (page * page_size + row), on CPU
    copy_dst: torch.Tensor | None = None
    drafts: list[Draft | None] = field(default_factory=list)  # per request (empty: no request has one)
    grammar: StepMasks | None = None  # token bitmasks of the constrained sampled rows, applied before sampling

    def copied_rows(self, i: int) -> int:
        return self.copied[i] if self.copied else 0

    def sample_drafts(self) -> list[list[int]]:
        """Per sampled request, in sample_infos order: its draft tokens (empty without one)."""
        if not self.drafts:
            return [[] for _ in self.sample_infos]
        return [d.tokens if d is not None else [] for d, r in zip(self.drafts, self.sample_rows) if r is not None]


@dataclass
class StepOutput:
    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    prompt_logprobs: list[tuple[list[float], list[list[tuple[float, int]]]]]  # per request with prompt rows
    failed: dict[int, str] = field(default_factory=dict)  # sampled row k -> why sampling it failed (see fail)
    runs: dict[int, DraftRun] = field(default_factory=dict)  # sampled row k with a draft -> every token it produced
