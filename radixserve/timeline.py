"""Request timelines: when each request was queued, each prefill chunk it ran, its decode steps, its retractions.

The engine loop feeds a `Tracker` a few calls per step (O(requests in the step), no device work, no locks), and the
Engine opens and closes a timeline around each request. Readers on other threads (the dashboard, the OpenTelemetry
exporter, the metrics) only read finished timelines or copy lists, which the GIL makes atomic; nothing here ever
waits for the loop or makes the loop wait.
"""

from __future__ import annotations

import bisect
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.io import GenerateOutput
    from radixserve.request import Req
    from radixserve.step import ScheduledBatch

log = logging.getLogger("radixserve.timeline")

# The W3C `traceparent` of the HTTP request being served (set by the server's middleware): the Engine copies it into
# the timeline when the request is submitted, which happens in the handler's context.
traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("radixserve_traceparent", default=None)

# Per-request event lists are bounded: a long decode keeps its first steps and a count of the rest.
MAX_EVENTS = 2048
RECENT_FINISHED = 256
CLOCK_MARKS = 4096


@dataclass(slots=True)
class Span:
    """One stretch of a request's life; times are time.perf_counter() seconds."""

    kind: str  # "queued" | "prefill" | "decode" | "retracted"
    start: float
    end: float | None = None
    tokens: int = 0  # prefill: tokens in the chunk; decode: 1
    prefix: int = 0  # prefill: tokens already in KV when the chunk ran (cached or computed earlier)


@dataclass
class RequestTimeline:
    rid: str
    namespace: str
    prompt_tokens: int
    created: float  # perf_counter at submission (the Req's `created`)
    traceparent: str | None = None
    spans: list[Span] = field(default_factory=list)
    dropped_events: int = 0  # decode steps past MAX_EVENTS, counted only
    decode_steps: int = 0
    retractions: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    waiting: Span | None = None  # the open "queued" or "retracted" span, until the next admission

    def add(self, span: Span) -> Span:
        """Record a span (past MAX_EVENTS only counted); returned either way, for its end to be set."""
        if len(self.spans) < MAX_EVENTS:
            self.spans.append(span)
        else:
            self.dropped_events += 1
        return span

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission to the first chunk run (None while still queued)."""
        first = next((s for s in self.spans if s.kind != "queued"), None)
        return None if first is None else first.start - self.created


class Tracker:
    """Timelines of live requests (reached through each Req.timeline) and of the last RECENT_FINISHED finished ones.

    `on_step(seconds, prefill_chunks)` listeners run on the loop thread, `on_finish(timeline)` ones on the output
    stage's (radixserve/output_stage.py): keep them cheap (a histogram observe, a queue put)."""

    def __init__(self) -> None:
        self.recent: deque[RequestTimeline] = deque(maxlen=RECENT_FINISHED)
        self.step_listeners: list[Callable[[float, list[int]], None]] = []
        self.finish_listeners: list[Callable[[RequestTimeline], None]] = []
        # perf_counter -> wall clock, to report epoch times (OpenTelemetry, the page)
        self.wall0, self.perf0 = time.time(), time.perf_counter()
        # (cache clock, perf_counter) marks: the radix tree stamps nodes with a logical clock; these map it to time
        self.clock_marks: deque[tuple[int, float]] = deque(maxlen=CLOCK_MARKS)
        # id(batch) -> (perf_counter when scheduled, prefill chunk sizes, spans it opened, timelines awaiting a token)
        self._launched: dict[int, tuple[float, list[int], list[Span], list[tuple[RequestTimeline, Req]]]] = {}

    def wall(self, perf: float) -> float:
        return self.wall0 + (perf - self.perf0)

    # ---- from the submitting thread -------------------------------------------------------------------------------
    def open(self, req: Req) -> RequestTimeline:
        tl = RequestTimeline(req.rid, req.namespace, len(req.input_ids), req.created, traceparent.get())
        tl.waiting = tl.add(Span("queued", req.created))
        return tl

    # ---- from the loop thread (a few attribute reads and one Span per request per step) -----------------------------
    def scheduled(self, batch: ScheduledBatch, cache: Any) -> None:
        now = time.perf_counter()
        prefills: list[int] = []
        opened: list[Span] = []
        firsts: list[tuple[RequestTimeline, Req]] = []
        self._launched[id(batch)] = (now, prefills, opened, firsts)
        clock = getattr(cache, "_clock", None)
        if clock is not None and (not self.clock_marks or self.clock_marks[-1][0] != clock):
            self.clock_marks.append((clock, now))
        for req, n in zip(batch.reqs, batch.chunks):
            tl: RequestTimeline | None = req.timeline
            prefix = req.kv_len - n  # _build has advanced kv_len by n already
            if tl is None:
                if n > 1:
                    prefills.append(n)
                continue
            waited = tl.waiting
            if waited is not None:  # admitted (again): a resume's first chunk is a prefill even of one token
                waited.end, tl.waiting = now, None
                tl.cached_tokens = req.cached_tokens
                _count_hits(req.node)
                decode = False
            else:
                decode = n == 1 and prefix >= tl.prompt_tokens and prefix + 1 >= req.num_fill
            if decode:
                tl.decode_steps += 1
            else:
                prefills.append(n)
            opened.append(tl.add(Span("decode" if decode else "prefill", now, None, n, prefix)))
            if tl.first_token is None:
                firsts.append((tl, req))

    def processed(self, batch: ScheduledBatch) -> None:
        now = time.perf_counter()
        start, chunks, opened, firsts = self._launched.pop(id(batch), (now, [], [], []))
        for span in opened:
            if span.end is None:  # a request that finished in this step closed its spans already (close)
                span.end = now
        for tl, req in firsts:
            if req.output_ids:
                tl.first_token = now
        for fn in self.step_listeners:
            fn(now - start, chunks)

    def discarded(self, batches: list[ScheduledBatch]) -> None:
        """Steps that failed: forget their launch times."""
        for b in batches:
            self._launched.pop(id(b), None)

    def retracted(self, req: Req) -> None:
        tl: RequestTimeline | None = req.timeline
        if tl is not None:
            tl.retractions += 1
            tl.waiting = tl.add(Span("retracted", time.perf_counter()))

    def close(self, req: Req, final: GenerateOutput | BaseException) -> None:
        """The request's final result (or its error) went out (from the output stage's thread): finish its timeline
        and hand it to the listeners."""
        tl: RequestTimeline | None = req.timeline
        if tl is None or tl.finished is not None:
            return
        now = time.perf_counter()
        fr = None if isinstance(final, BaseException) else final.finish_reason
        for span in tl.spans:
            if span.end is None:
                span.end = now
        tl.finished, tl.finish_reason = now, "error" if fr is None else fr.type
        # Ids past a stop string that the loop made before it heard of the stop are not the answer's.
        tl.completion_tokens = (
            len(req.output_ids) if isinstance(final, BaseException) else final.meta_info.completion_tokens
        )
        tl.cached_tokens = req.cached_tokens
        self.recent.append(tl)
        for fn in self.finish_listeners:
            try:
                fn(tl)
            except Exception:  # noqa: BLE001 - a listener's fault must never reach the engine loop
                log.exception("timeline listener failed")

    # ---- from any thread ------------------------------------------------------------------------------------------
    def clock_time(self, clock: int) -> float | None:
        """Approximate perf_counter time at which the tree's logical clock read `clock` (None: before the marks)."""
        marks = list(self.clock_marks)
        i = bisect.bisect_left(marks, (clock, float("-inf")))
        if i == len(marks):
            return marks[-1][1] if marks else None
        if i == 0 and marks[0][0] > clock:
            return None
        return marks[i][1]


def _count_hits(node: Any) -> None:
    """A request was admitted onto `node`'s path: count a hit on every node of it (the root has no parent)."""
    while node is not None and node.parent is not None:
        node.hits += 1
        node = node.parent
