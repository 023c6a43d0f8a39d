"""Agent retention's tool gaps (radixserve/server/agent_retention.py): the time a turn's prefix is retained is the
90th percentile of its group's gaps times a margin, within bounds; groups never mix; parallel calls are one gap."""

from __future__ import annotations

import pytest

from radixserve.server import agent_retention as ar
from radixserve.server.agent_retention import ToolGaps
from radixserve.server.protocol import ChatMessage


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def result(call_id: str) -> ChatMessage:
    return ChatMessage(role="tool", content="42", tool_call_id=call_id)


def cycle(gaps: ToolGaps, clock: Clock, group: str, gap: float, n: int, tag: str = "") -> float:
    """n turns of `group` that end in a call answered `gap` seconds later; returns the last ttl handed out."""
    ttl = 0.0
    for i in range(n):
        ttl = gaps.called(group, [f"{tag}{group}-{i}"])
        clock.t += gap
        gaps.results(group, [ChatMessage(role="user", content="hi"), result(f"{tag}{group}-{i}")])
    return ttl


def test_default_until_enough_gaps_then_the_p90_with_a_margin() -> None:
    clock = Clock()
    gaps = ToolGaps(clock)
    g = ToolGaps.group("tenant", None)
    assert cycle(gaps, clock, g, 3.0, ar.MIN_GAPS) == ar.DEFAULT_S, "each turn's ttl is set before its gap is seen"
    assert gaps.ttl(g) == pytest.approx(3.0 * ar.MARGIN)
    for gap in [1.0] * 8 + [10.0]:  # 4 x 3 s, 8 x 1 s, 1 x 10 s: the 90th percentile is 3 s
        cycle(gaps, clock, g, gap, 1, tag=str(gap))
    assert gaps.ttl(g) == pytest.approx(3.0 * ar.MARGIN)


def test_ttl_is_bounded() -> None:
    clock = Clock()
    gaps = ToolGaps(clock)
    cycle(gaps, clock, "fast", 0.01, ar.MIN_GAPS)
    cycle(gaps, clock, "slow", 5000.0, ar.MIN_GAPS)
    assert gaps.ttl("fast") == ar.MIN_S and gaps.ttl("slow") == ar.MAX_S


def test_groups_do_not_mix_and_foreign_ids_never_count() -> None:
    clock = Clock()
    gaps = ToolGaps(clock)
    a, b = ToolGaps.group("a", None), ToolGaps.group("a", "search-agent")
    assert a != b and ToolGaps.group("b", None) != a
    cycle(gaps, clock, a, 2.0, 6)
    gaps.called(a, ["call_x"])
    clock.t += 50
    gaps.results(ToolGaps.group("b", None), [result("call_x")])  # another tenant replays a's call id
    assert len(gaps.groups[a].recent) == 6 and "call_x" in gaps.pending
    assert gaps.ttl(b) == ar.DEFAULT_S


def test_parallel_calls_of_one_turn_are_one_gap() -> None:
    clock = Clock()
    gaps = ToolGaps(clock)
    gaps.called("g", ["c1", "c2", "c3"])
    clock.t += 4
    gaps.results("g", [result("c1"), result("c2"), result("c3")])
    assert list(gaps.groups["g"].recent) == [4.0] and not gaps.pending


def test_pending_calls_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ar, "MAX_PENDING", 3)
    gaps = ToolGaps(Clock())
    gaps.called("g", ["a", "b", "c", "d", "e"])
    assert list(gaps.pending) == ["c", "d", "e"]


def test_a_few_short_gaps_do_not_cut_the_ttl_while_a_long_call_is_still_out() -> None:
    # Agents start together: the first results back are the fast tools', while the slow tool's call is still out.
    clock = Clock()
    gaps = ToolGaps(clock)
    slow_ttl = gaps.called("g", ["slow"])
    cycle(gaps, clock, "g", 2.0, 6, tag="fast")
    later_ttl = gaps.called("g", ["later"])
    clock.t = 15.0
    gaps.results("g", [result("slow")])
    assert slow_ttl >= 15.0 and later_ttl == ar.DEFAULT_S >= 15.0, "six 2 s gaps are not a 90th percentile"
