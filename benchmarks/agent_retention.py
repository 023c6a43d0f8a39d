"""Agents across tool calls under a flood (issue 37): LRU only vs automatic agent retention vs cache_control hints.

Many agents run at once, each several turns of think -> tool call -> tool result after a random gap (1-20 s, times
--time-scale), every turn's prompt being the whole history so far plus the tool's result; beside them a closed-loop
flood of unrelated one-shot prompts (--flood-workers at a time) overflows the KV pool. Per mode it reports the agent
turns' history hit rate (of the tokens a turn shares with its previous turn, the share served from the cache), the
agents' job completion time p50/p95 (first turn sent to last turn done, tool gaps included) and their serving time
(the same less the gaps: what the engine made them wait), and the flood's throughput (requests done per second).

Modes, on one in-process Engine (flushed between them; the same seeded gaps and prompts in each):
- lru: no retention.
- auto: the server's agent retention, driven as the server drives it: `ToolGaps` (radixserve/server/
  agent_retention.py) learns the gaps from the call ids a turn ends in and the results the next turn brings, and
  `Engine.retain(prompt + output, ttl, priority 40, wait=False)` retains each turn that ends in a tool call.
- cache_control: every agent turn carries `retention_seconds=300` (what a /v1/messages turn with a 5m
  cache_control marker gets).

The defaults are the workload reasoned in benchmarks/RESULTS.md (issue 37, sessions 10-12): 4 agents of 6 turns
starting 4 s apart, 8,192-token contexts, 256-token tool results, 32-token turns, the issue's gaps unscaled, a
45,056-token pool 0.9 of which may be retained (every agent's whole history, 4 x 9,664 tokens, fits; the pool turns
over within a typical gap), 3 rounds with the modes' order turned each round. A later turn's recompute must cost a
good part of a gap for retention to show in the job time, and turn 0 (the same cold prefill in every mode) weighs
less the more turns an agent runs. --turn-log keeps every turn, to see which turns of the slow agents missed or
waited.

    python -m benchmarks.agent_retention [--one-tenant] [--agents 4] [--pool-tokens 45056] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.random_model import make_random_model
from radixserve_kernels import cpu as cpu_kernels
from radixserve import Engine
from radixserve.server.agent_retention import PRIORITY, ToolGaps
from radixserve.server.protocol import ChatMessage

MODES = ("lru", "auto", "cache_control")
VOCAB = 512


@dataclass
class Agent:
    context: list[int]  # its system prompt and task: unique per agent
    gaps: list[float]  # seconds of tool time after each turn but the last
    results: list[list[int]]  # the tool result each later turn appends


@dataclass
class Tally:
    hit: int = 0  # history tokens served from the cache (turns 2+)
    history: int = 0  # history tokens those turns could have reused
    jct: list[float] = field(default_factory=list)
    serving: list[float] = field(default_factory=list)
    tool: list[float] = field(default_factory=list)  # each agent's tool time (the sum of its gaps)
    later_ttft: list[float] = field(default_factory=list)  # turns 2+: queue + prefill, where recompute shows
    later_decode: list[float] = field(default_factory=list)  # turns 2+: first token to last
    flood_done: int = 0
    flood_s: float = 0.0
    turns: list[dict[str, Any]] = field(default_factory=list)  # one record a turn, for --turn-log
    rounds: list[dict[str, Any]] = field(default_factory=list)  # one record a round: its agents' serving, the cache's


def make_agents(n: int, turns: int, context: int, result: int, scale: float, seed: int) -> list[Agent]:
    rng = random.Random(seed)
    return [
        Agent(
            [rng.randrange(3, VOCAB) for _ in range(context)],
            [rng.uniform(1.0, 20.0) * scale for _ in range(turns - 1)],
            [[rng.randrange(3, VOCAB) for _ in range(result)] for _ in range(turns - 1)],
        )
        for _ in range(n)
    ]


async def run_agent(eng: Engine, a: Agent, i: int, mode: str, gaps: ToolGaps, tally: Tally, args: Any) -> None:
    params = {"max_new_tokens": args.think_tokens, "temperature": 0, "ignore_eos": True}
    extra = {"retention_seconds": 300.0} if mode == "cache_control" else {}
    tenant = args.agent_tenant
    prompt, start, waited, group = list(a.context), time.perf_counter(), 0.0, ToolGaps.group(tenant, None)
    history, ttl = 0, None
    ps = args.page_size
    for turn in range(len(a.gaps) + 1):
        sent = time.perf_counter()
        out = await eng.async_generate(input_ids=prompt, sampling_params=params, tenant=tenant, **extra)
        meta = out["meta_info"]
        # Why a slow agent was slow: which of its turns missed, whether the retention it had (auto) had run out
        # before the turn was sent (gap > ttl) or after, and where its serving time went.
        tally.turns.append(
            {
                "mode": mode,
                "round": args.round,
                "agent": i,
                "turn": turn,
                "sent": round(sent - args.t0, 2),
                "history": history,
                "cached": meta["cached_tokens"],
                "gap": a.gaps[turn - 1] if turn else None,
                "ttl": ttl,
                "ttft": round(meta["ttft"], 3),
                "e2e": round(meta["e2e_latency"], 3),
                "served": round(time.perf_counter() - sent, 3),
            }  # fmt: skip
        )
        if turn > 0:
            tally.hit += min(meta["cached_tokens"], history)
            tally.history += history
            tally.later_ttft.append(meta["ttft"])
            tally.later_decode.append(meta["e2e_latency"] - meta["ttft"])
        if turn == len(a.gaps):
            break
        call_id = f"call-{mode}-{i}-{turn}"
        full = prompt + out["output_ids"]
        if mode == "auto":  # the turn ended in a tool call: what agent_retention.retain_turn does
            ttl = gaps.called(group, [call_id])
            eng.retain(full, ttl, PRIORITY, tenant=tenant, wait=False)
        history = (len(full) - 1) // ps * ps  # the last output token has no KV yet; the tree keeps full pages
        await asyncio.sleep(a.gaps[turn])
        waited += a.gaps[turn]
        gaps.results(group, [ChatMessage(role="tool", content="", tool_call_id=call_id)])
        prompt = full + a.results[turn]
    done = time.perf_counter() - start
    tally.jct.append(done)
    tally.serving.append(done - waited)
    tally.tool.append(waited)


async def flood(eng: Engine, w: int, stop: asyncio.Event, done: list[int], args: Any) -> None:
    rng = random.Random(1000 + w)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    while not stop.is_set():
        ids = [rng.randrange(3, VOCAB) for _ in range(args.flood_tokens)]
        await eng.async_generate(input_ids=ids, sampling_params=params, tenant=args.flood_tenant)
        done[0] += 1


async def run_mode(eng: Engine, agents: list[Agent], mode: str, args: Any, tally: Tally) -> None:
    gaps, stop, done = ToolGaps(), asyncio.Event(), [0]
    floods = [asyncio.create_task(flood(eng, w, stop, done, args)) for w in range(args.flood_workers)]
    while done[0] * args.flood_tokens < args.warmup * args.pool_tokens:  # the flood fills the pool first
        await asyncio.sleep(0.1)

    async def staggered(i: int, a: Agent) -> None:
        await asyncio.sleep(i * args.stagger)
        await run_agent(eng, a, i, mode, gaps, tally, args)

    t0, before, stats0 = time.perf_counter(), done[0], eng.cache_stats()
    args.t0, first = t0, len(tally.serving)
    await asyncio.gather(*(staggered(i, a) for i, a in enumerate(agents)))
    tally.flood_s += time.perf_counter() - t0  # the flood's requests done while the agents ran
    tally.flood_done += done[0] - before
    stats = eng.cache_stats()
    tally.rounds.append(
        {
            "round": args.round,
            "serving": [round(x, 2) for x in tally.serving[first:]],
            "flood_req_s": round((done[0] - before) / (time.perf_counter() - t0), 2),
            "load": os.getloadavg()[0],
            **{
                k: stats[k] - stats0[k]
                for k in ("retentions", "retentions_refused", "retention_expired_nodes", "retention_displaced_nodes")
            },
        }  # fmt: skip
    )
    stop.set()
    await asyncio.gather(*floods)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--result-tokens", type=int, default=256)
    ap.add_argument("--think-tokens", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=1.0, help="tool gaps are 1-20 s times this")
    ap.add_argument("--stagger", type=float, default=4.0, help="seconds between agent starts")
    ap.add_argument("--warmup", type=float, default=1.0, help="pools' worth of flood tokens before the agents start")
    ap.add_argument("--flood-workers", type=int, default=3)
    ap.add_argument("--flood-tokens", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=45056)
    ap.add_argument("--retained-share", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turn-log", default=None, help="append every turn and round to this file as JSON lines")
    ap.add_argument("--model", default=None, help="a model folder or GGUF (default: a random 4-layer Llama)")
    ap.add_argument(
        "--one-tenant",
        action="store_true",
        help="agents and flood in one tenant, as on a server without API keys (default: two keys' tenants, which "
        "share prefill fairly)",
    )
    args = ap.parse_args()
    args.agent_tenant, args.flood_tenant = ("", "") if args.one_tenant else ("agents", "flood")
    agents = make_agents(args.agents, args.turns, args.context_tokens, args.result_tokens, args.time_scale, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        # The random model's positions cover the longest turn: its context, every result and every answer.
        longest = args.context_tokens + (args.turns - 1) * args.result_tokens + args.turns * args.think_tokens
        model = args.model or make_random_model(
            Path(tmp) / "m",
            layers=4,
            hidden=512,
            heads=8,
            kv_heads=4,
            intermediate=1536,
            vocab=VOCAB,
            context=max(8192, -(-longest // 1024) * 1024),
        )
        eng = Engine(
            model=model,
            max_total_tokens=args.pool_tokens,
            max_retained_share=args.retained_share,
            max_retained_share_per_tenant=args.retained_share,
        )
        args.page_size = eng.cache_stats()["page_size"]
        results = {mode: Tally() for mode in MODES}
        try:
            # Untimed: the first steps of every shape pay for packing and kernel builds.
            warm = argparse.Namespace(**{**vars(args), "warmup": 0.1, "round": 0})
            asyncio.run(run_mode(eng, agents[:2], "lru", warm, Tally()))
            for r in range(args.rounds):  # the order turns each round, so a drifting machine hits every mode alike
                args.round = r + 1
                for mode in MODES if r % 2 == 0 else reversed(MODES):
                    assert eng.flush_cache()
                    asyncio.run(run_mode(eng, agents, mode, args, results[mode]))
                    eng.check_invariants()
                    if args.turn_log:  # as each mode ends, so a run cut short still tells what it saw
                        t = results[mode]
                        with open(args.turn_log, "a") as f:
                            for rec in [{"mode": mode, **t.rounds[-1]}] + t.turns[-args.agents * args.turns :]:
                                f.write(json.dumps(rec) + "\n")
                    print(f"round {r + 1} {mode} done at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
        finally:
            eng.shutdown()
    report(results, args)


def report(results: dict[str, Tally], args: Any) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"machine: {platform.node()}, CPU {cpu_kernels.cpu_model()} {' '.join(cpu_kernels.kind_flags())}, ")
    print(f"  {torch.get_num_threads()} threads, torch {torch.__version__}; {now}; commit {commit}")
    print(f"load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"workload: {vars(args)}")
    print(
        "| mode | agent history hit rate | agent JCT p50 / p95 (s) | tool time p50 (s) | serving p50 / p95 (s) "
        "| turns 2+: queue+prefill p50 / p95 (s) | turns 2+: decode p50 (s) | flood req/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, t in results.items():
        rate = t.hit / t.history if t.history else 0.0
        print(
            f"| {mode} | {rate:.1%} | {pct(t.jct, 50):.2f} / {pct(t.jct, 95):.2f} | {pct(t.tool, 50):.2f} | "
            f"{pct(t.serving, 50):.2f} / {pct(t.serving, 95):.2f} | "
            f"{pct(t.later_ttft, 50):.2f} / {pct(t.later_ttft, 95):.2f} | {pct(t.later_decode, 50):.2f} | "
            f"{t.flood_done / t.flood_s:.2f} |"
        )
    lru = results["lru"]
    lru_rate = lru.hit / lru.history if lru.history else 0.0
    for mode in MODES[1:]:
        t = results[mode]
        rate = t.hit / t.history if t.history else 0.0
        jct = pct(lru.jct, 95) / pct(t.jct, 95)
        flood_ratio = (t.flood_done / t.flood_s) / (lru.flood_done / lru.flood_s)
        print(
            f"{mode} vs lru: hit rate {rate:.1%} vs {lru_rate:.1%} (goal >= 90% where lru < 50%: "
            f"{'met' if rate >= 0.9 and lru_rate < 0.5 else 'NOT met'}); JCT p95 {jct:.2f}x (goal >= 1.5x: "
            f"{'met' if jct >= 1.5 else 'NOT met'}); serving p95 {pct(lru.serving, 95) / pct(t.serving, 95):.2f}x; "
            f"flood throughput {flood_ratio:.2f}x (goal: no more than 10% lower: "
            f"{'met' if flood_ratio >= 0.9 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
