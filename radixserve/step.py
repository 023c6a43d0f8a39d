"""One scheduled step: what the model computes and samples, and what comes back. The types between the scheduler
and the model runner, below both (the runner imports nothing of the scheduler)."""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.constrained.bitmask import StepMasks
from radixserve.forward_batch import ForwardBatch
from radixserve.request import Req
from radixserve.sampling.info import SamplingInfo


@dataclass
class ScheduledBatch:
    """Request i runs `chunks[i]` tokens from the kv_len it had when scheduled.

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
    prompt_targets: list[tuple[list[int], int]]  # per request with prompt rows: (prompt tokens scored, top-k wanted)
    has_placeholders: bool = False  # some input ids are slots of tokens still being sampled
    needs_sync: bool = False  # a sampled request reads its own output history (penalties): it must be current
    grammar: StepMasks | None = None  # token bitmasks of the constrained sampled rows, applied before sampling


@dataclass
class StepOutput:
    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    prompt_logprobs: list[tuple[list[float], list[list[tuple[float, int]]]]]  # per request with prompt rows
    failed: dict[int, str] = field(default_factory=dict)  # sampled row k -> why sampling it failed (see fail)
