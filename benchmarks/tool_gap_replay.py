"""Replay agent_retention's ToolGaps over the agent benchmark's tool gaps, without an engine (issue 37).

Agents start `--stagger` s apart; each turn is served in `--serve` s, then its tool call comes back after a gap drawn
uniformly from 1-20 s (the issue's gaps, as benchmarks/agent_retention.py draws them; seeded, not its exact draws).
Every turn that ends in a call gets the TTL `ToolGaps.called` hands out at that moment; a gap is late when it outlasts
that TTL (the prefix's retention ran out before the result came back). Prints the late gaps per seed.

    python -m benchmarks.tool_gap_replay [--agents 8] [--seeds 12]
"""

from __future__ import annotations

import argparse
import heapq
import random

from radixserve.server import agent_retention
from radixserve.server.agent_retention import ToolGaps
from radixserve.server.protocol import ChatMessage


def late_gaps(seed: int, agents: int, turns: int, serve: float, stagger: float) -> tuple[int, int]:
    """(gaps that outlasted their TTL, gaps) for one seed: one group, the agents' events in time order."""
    rng = random.Random(seed)
    gaps = [[rng.uniform(1.0, 20.0) for _ in range(turns - 1)] for _ in range(agents)]
    now = [0.0]
    tool_gaps, group = ToolGaps(lambda: now[0]), ToolGaps.group("", None)
    # (time, kind, agent, turn, ttl): kind 0 a result arriving, 1 a turn ending; results first at equal times.
    events = [(i * stagger + serve, 1, i, 0, 0.0) for i in range(agents)]
    heapq.heapify(events)
    late = total = 0
    while events:
        now[0], kind, i, turn, ttl = heapq.heappop(events)
        if kind == 0:
            tool_gaps.results(group, [ChatMessage(role="tool", content="", tool_call_id=f"{i}-{turn}")])
            total += 1
            late += gaps[i][turn] > ttl
            heapq.heappush(events, (now[0] + serve, 1, i, turn + 1, 0.0))
        elif turn < turns - 1:
            ttl = tool_gaps.called(group, [f"{i}-{turn}"])
            heapq.heappush(events, (now[0] + gaps[i][turn], 0, i, turn, ttl))
    return late, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--serve", type=float, default=3.0, help="seconds each turn is served")
    ap.add_argument("--stagger", type=float, default=0.3, help="seconds between agent starts")
    ap.add_argument("--seeds", type=int, default=12)
    args = ap.parse_args()
    runs = [late_gaps(s, args.agents, args.turns, args.serve, args.stagger) for s in range(args.seeds)]
    print(f"MIN_GAPS {agent_retention.MIN_GAPS}, DEFAULT_S {agent_retention.DEFAULT_S}: late gaps per seed")
    print(" ".join(str(late) for late, _ in runs), f"= {sum(r[0] for r in runs)} of {sum(r[1] for r in runs)}")


if __name__ == "__main__":
    main()
