"""Retention for agents: a turn that ends in tool calls keeps its prefix (prompt + output) retained until the tool
results come back, for a time learned from the tool gaps this server has seen.

A gap is the time from a turn that ended in tool calls to the request that brings one of their results (its tool
message names the call id this server made). Gaps are kept per group, a tenant (its key's namespace, else its cache
namespace) and its `prompt_cache_key` (OpenAI's bucket for requests that share a prefix), so one agent's slow tools
do not set another's time. The time is the 90th percentile of the group's last gaps, times a margin, within bounds:
long enough for most results to find their prefix, short enough that an agent that never comes back gives its pages
back soon. Before a group has enough gaps it gets DEFAULT_S. Off with `--no-agent-retention`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from radixserve.errors import EngineDeadError
from radixserve.io import GenerateOutput
from radixserve.server.handler import Job
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage
from radixserve.server.serving import ServerState

DEFAULT_S = 30.0  # before a group has MIN_GAPS gaps
MIN_S, MAX_S = 2.0, 600.0
MARGIN = 1.25  # the p90 gap times this: a gap a little past the percentile still finds its prefix
# Below 10 gaps the 90th percentile is only the largest gap seen, and the first gaps to come back are the short ones
# (the long calls are still out), so a percentile learned from 4-7 gaps handed out TTLs shorter than gaps still due:
# 26 of 288 gaps of 1-20 s came back late in benchmarks/tool_gap_replay.py (8 agents, seeds 0-11), 2 with 10.
MIN_GAPS = 10
WINDOW = 64  # gaps remembered per group
MAX_GROUPS = 4096
MAX_PENDING = 16384  # tool calls waiting for their results, oldest dropped first
PRIORITY = 40  # below explicit hints' default (50): a client's own cache_control outranks a guess


@dataclass
class Gaps:
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def ttl(self) -> float:
        if len(self.recent) < MIN_GAPS:
            return DEFAULT_S
        ordered = sorted(self.recent)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return min(MAX_S, max(MIN_S, p90 * MARGIN))


class ToolGaps:
    """Tool calls made (call id -> group, time) and the gaps measured when their results arrive, per group."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pending: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.groups: OrderedDict[str, Gaps] = OrderedDict()  # least recently used first, bounded by MAX_GROUPS

    @staticmethod
    def group(tenant: str, prompt_cache_key: str | None) -> str:
        """The group's name: a digest, so a client's long prompt_cache_key costs MAX_GROUPS entries nothing more."""
        return hashlib.blake2b(f"{tenant}\x00{prompt_cache_key or ''}".encode(), digest_size=16).hexdigest()

    def called(self, group: str, call_ids: Iterable[str]) -> float:
        """A turn of `group` ended in these tool calls: remember when, and return how long to retain its prefix."""
        now = self.clock()
        for cid in call_ids:
            self.pending[cid] = (group, now)
            self.pending.move_to_end(cid)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        return self._gaps(group).ttl()

    def results(self, group: str, messages: Iterable[ChatMessage]) -> None:
        """A request arrived: each tool result answering a call of the same group (another tenant's ids never count)
        adds one gap; the first result of a turn's calls measures it, the others only clear their ids."""
        now = self.clock()
        measured: set[float] = set()
        for m in messages:
            if m.role != "tool" or m.tool_call_id is None:
                continue
            made = self.pending.get(m.tool_call_id)
            if made is None or made[0] != group:
                continue
            del self.pending[m.tool_call_id]
            if made[1] not in measured:  # parallel calls of one turn: one gap
                measured.add(made[1])
                self._gaps(group).recent.append(now - made[1])

    def ttl(self, group: str) -> float:
        gaps = self.groups.get(group)
        return gaps.ttl() if gaps is not None else DEFAULT_S

    def _gaps(self, group: str) -> Gaps:
        gaps = self.groups.get(group)
        if gaps is None:
            gaps = self.groups[group] = Gaps()
            while len(self.groups) > MAX_GROUPS:
                self.groups.popitem(last=False)
        self.groups.move_to_end(group)
        return gaps


def gap_group(state: ServerState, req: ChatCompletionRequest, tenant: str | None, salt: str) -> str:
    """The request's group for tool gaps (its tenant, else its namespace, and its prompt_cache_key); the tool results
    it brings back are measured now."""
    group = ToolGaps.group(tenant or salt, req.prompt_cache_key)
    if state.tool_gaps is not None:
        state.tool_gaps.results(group, req.messages)
    return group


def retain_turn(state: ServerState, job: Job, out: GenerateOutput, call_ids: list[str]) -> None:
    """A chat turn ended in tool calls: retain its prompt + output for its group's learned gap. Queued for the
    engine's loop, never awaited: the answer goes out at once."""
    gaps = state.tool_gaps
    if gaps is None or not call_ids or len(job.calls) != 1:
        return
    call = job.calls[0]
    assert isinstance(call.input_ids, list)
    seconds = gaps.called(job.group, call_ids)
    try:
        ids = call.input_ids + out.output_ids  # type: ignore[operator]
        state.engine.retain(ids, seconds, PRIORITY, call.cache_salt, call.tenant, wait=False)
    except EngineDeadError:
        pass  # the answer is out already; the server notices a dead engine on its next request
