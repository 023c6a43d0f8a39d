"""One generation request as the scheduler sees it: tokens, KV pages, progress and results."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.retention import Retention
from radixserve.constrained.grammar import GrammarMatcher
from radixserve.io import FinishReason
from radixserve.page_list import PageList, PageListField
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    """Where a request is: the scheduler's queue it sits in (checked by Scheduler.check_invariants)."""

    WAITING = "waiting"  # in `waiting`, holding no pages (new, or retracted to run again)
    RUNNING = "running"  # in `running`: admitted, holding pages and a runner slot
    FINISHING = "finishing"  # finished while a step of it is still in flight: its pages go back when that is done
    DONE = "done"  # finished and holding nothing


@dataclass(eq=False)  # a request is equal only to itself: `req in running` must not compare fields
class Req:
    """KV for `fill_ids[:kv_len]` lives in `pages`; the first `num_tree_pages` of them belong to the radix tree.

    `fill_ids` is the prompt plus what was generated, so a retracted request resumes by prefilling it again
    (mostly from the cache). `output_ids` only grows (the output stage reads it from its own thread, up to the
    length each ReqUpdate names); its text, stop strings and results are the output stage's (`output`).
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    sampling: SamplingInfo
    namespace: str = ""
    tenant: str = ""  # fair-share group (radixserve/scheduler/fairness.py)
    priority: int = 0  # higher is admitted first and may retract lower-priority running requests
    retention: Retention | None = None  # once finished, its cached prefix is retained (radixserve/cache/retention.py)
    deadline: float | None = None  # perf_counter time past which the request is aborted
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    grammar: GrammarMatcher | None = None  # constrained decoding: which tokens may come next

    output_ids: list[int] = field(default_factory=list)
    pages: PageList = PageListField()  # type: ignore[assignment]  # any list assigned is kept as a PageList
    kv_len: int = 0
    num_tree_pages: int = 0
    node: Any = None  # the radix-tree node this request holds a lock on
    tail: Any = None  # its live partial-page record, readable by other requests (cache/partial_page.py)
    admitted: bool = False  # first admission done (cache accounting happens once)
    slot: int = -1  # while running: where the runner leaves this request's newest sampled id (see ScheduledBatch)
    steps_in_flight: int = 0  # scheduled steps not yet processed: the request's pages stay until they are
    kv_inflight: int = 0  # tokens of kv_len that steps in flight are still computing (never cached before done)
    inflight_tokens: int = 0  # tokens sampled by such steps that the scheduler has not seen yet
    cached_tokens: int = 0
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    draft_state: Any = None  # speculative decoding's per-request state (radixserve/speculative/drafter.py)
    timeline: Any = None  # its radixserve.timeline.RequestTimeline (the Engine opens one per request)
    output: Any = None  # its radixserve.output_stage.ReqOutput: text, stop strings, what was sent (never the loop's)

    # logprobs gathered so far
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    next_prompt_logprob_pos: int = -1  # next prompt position whose logprob is still owed (-1: none wanted)

    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    fill_ids: list[int] = field(default_factory=list)  # input_ids + output_ids, kept whole for cheap slicing

    def __post_init__(self) -> None:
        self.fill_ids = self.input_ids + self.output_ids

    def append_token(self, tok: int) -> None:
        self.output_ids.append(tok)
        self.fill_ids.append(tok)

    @property
    def num_fill(self) -> int:
        return len(self.fill_ids)

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_fill + self.inflight_tokens - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "error"

    def match_ids(self) -> list[int]:
        """The tokens to look up in the radix cache: prompt logprobs still owed must be computed, not looked up.

        Position p's logprob comes from the logits of row p-1, so the cache may serve at most p-1 tokens."""
        if self.next_prompt_logprob_pos >= 0:
            return self.fill_ids[: self.next_prompt_logprob_pos]
        return self.fill_ids


@dataclass(slots=True)
class ReqUpdate:
    """What the loop thread hands the output stage about one request: its first `num_ids` output ids are final (the
    list only grows, so the stage reads them from the request), and `finish`, if set, ended it there on a token-level
    condition (stop token, length, abort, grammar). `error`: it failed (or the engine died); the caller gets that."""

    req: Req
    num_ids: int
    finish: FinishReason | None = None
    error: BaseException | None = None
