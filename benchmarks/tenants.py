"""Two tenants, one flooding at 10x the other's rate (issue 21): the quiet tenant's time to first token alone, beside
the flood with fair share on, and with it off; and high-priority requests under a low-priority flood vs unloaded.

Open-loop Poisson arrivals against the in-process Engine (the server passes each API key's namespace as the
request's `tenant`, so this is what two keys get, without the HTTP client sharing the CPU with the engine). The
flood's prompts share a long system prompt, so longest-prefix-first favours them; the quiet tenant's prompts are
unique. The scenarios run interleaved, round after round, so drift of a shared machine hits them alike. A flood
request still queued when a scenario ends is aborted; a quiet request that waits past --give-up s counts as that long.

    python -m benchmarks.tenants [--rate 1] [--flood-factor 10] [--duration 20] [--rounds 2] [--flood-unique 32]
        [--no-priority] [--before]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.random_model import make_random_model
from radixserve import Engine

SYSTEM = list(range(3, 259))  # the flood's shared system prompt: 256 tokens, cached after the first request


class StepLog:
    """When each engine step ended and how many tokens it ran: the work a request waited for before its first token
    is the tokens of the steps that ended between its arrival and its first token, a measure of the scheduling that
    the other sessions on a shared CPU do not blur (wall time they do). Split three ways: the flood's prefill, every
    decode (with its draft), and the rest (the measured tenant's own prefill)."""

    def __init__(self, eng: Engine) -> None:
        self.ends: list[float] = []
        self.cum: list[tuple[int, int, int]] = [(0, 0, 0)]  # running totals: all tokens, flood prefill, decodes
        execute = eng.runner.execute

        def logged(batch: Any) -> Any:
            out = execute(batch)
            self.ends.append(time.perf_counter())
            flood = decode = 0
            for i, (req, n) in enumerate(zip(batch.reqs, batch.chunks)):
                if n == 1 or (batch.drafts and batch.drafts[i] is not None):
                    decode += n
                elif req.tenant == "flood" and req.priority == 0:
                    flood += n
            total, f, d = self.cum[-1]
            self.cum.append((total + sum(batch.chunks), f + flood, d + decode))
            return out

        eng.runner.execute = logged  # type: ignore[method-assign]

    def work(self, start: float, end: float) -> tuple[int, int, int]:
        """Tokens of the steps that ended in (start, end]: all, the flood's prefill, decodes."""
        lo, hi = bisect.bisect_right(self.ends, start), bisect.bisect_right(self.ends, end)
        a, b = self.cum[hi], self.cum[lo]
        return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


class Load:
    """One open-loop stream of requests: Poisson arrivals at `rate` for `duration` s; TTFTs of those that finish."""

    def __init__(
        self,
        eng: Engine,
        rate: float,
        tenant: str,
        prompt: Any,
        new_tokens: int,
        priority: int = 0,
        give_up: float | None = None,
        steps: StepLog | None = None,
    ) -> None:
        self.eng, self.rate, self.tenant, self.prompt = eng, rate, tenant, prompt
        self.new_tokens, self.priority, self.give_up = new_tokens, priority, give_up
        self.ttfts: list[float] = []
        self.steps = steps
        self.spans: list[tuple[float, float]] = []  # (arrival, first token) of those that got one
        self.gave_up = 0
        self.tasks: list[asyncio.Task] = []

    async def one(self, i: int) -> None:
        start = time.perf_counter()
        kwargs = dict(
            input_ids=self.prompt(i),
            sampling_params={"max_new_tokens": self.new_tokens, "temperature": 0, "ignore_eos": True},
            tenant=self.tenant,
            priority=self.priority,
            timeout=self.give_up,
        )
        if self.steps is None:  # the flood: only its load matters
            await self.eng.async_generate(**kwargs)
            return
        first_seen = None
        async for chunk in self.eng.async_generate(**kwargs, stream=True):  # the first chunk follows its step
            first_seen = first_seen or time.perf_counter()
            meta = chunk["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            self.gave_up += 1
            self.ttfts.append(self.give_up or 0.0)
        else:
            self.ttfts.append(meta["ttft"])
            self.spans.append((start, first_seen or start))

    def works(self) -> list[tuple[int, int, int]]:
        assert self.steps is not None
        return [self.steps.work(a, b) for a, b in self.spans]

    async def arrivals(self, duration: float, rng: random.Random) -> None:
        start = time.perf_counter()
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(self.rate)
            if t > duration:
                return
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            self.tasks.append(asyncio.ensure_future(self.one(i)))
            i += 1


async def scenario(measured: Load, flood: Load | None, duration: float, seed: int) -> None:
    """Run the measured load (and the flood beside it) for `duration` s; wait for the measured requests, then
    abort what the flood still has queued."""
    rng = random.Random(seed)
    loads = [measured] + ([flood] if flood else [])
    await asyncio.gather(*(ld.arrivals(duration, random.Random(rng.random())) for ld in loads))
    await asyncio.gather(*measured.tasks)
    if flood:
        for t in flood.tasks:
            t.cancel()  # cancelling aborts the request in the engine
        await asyncio.gather(*flood.tasks, return_exceptions=True)
    while measured.eng.metrics()["num_running"] or measured.eng.metrics()["num_waiting"]:
        await asyncio.sleep(0.05)


def whole_steps(eng: Engine, room: bool = True, join: bool = True) -> None:
    """Fair share as first shipped, for comparison in the same run: without its `room` rule a tenant may fill a whole
    step's prefill budget whoever else is active; without its `join` rule a prompt too long to merge waits for a step
    free of other tenants' prefill. Turns off the rules given True (both by default)."""
    sched = eng.scheduler
    if room:
        sched.fair.room = lambda tenant: sched.cfg.chunked_prefill_size  # type: ignore[union-attr, method-assign]
    if join:
        sched._may_join = lambda req, chunk, chunks: sched._may_merge(chunk, chunks)  # type: ignore[method-assign]


def slowest_tenth(works: list[tuple[int, int, int]]) -> tuple[float, float, float]:
    """Mean tokens the slowest 10% (by work, StepLog.work) waited for: the flood's prefill, decodes, the rest."""
    top = sorted(works)[-max(1, len(works) // 10) :]
    total, flood, decode = (float(np.mean([w[i] for w in top])) for i in range(3))
    return flood, decode, total - flood - decode


def p95(xs: list[float]) -> float:
    return float(np.percentile(xs, 95)) if xs else float("nan")


def machine() -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
    return (
        f"{platform.node()}, CPU {name}, {torch.get_num_threads()} torch threads, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {time.strftime('%Y-%m-%d %H:%M')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.0, help="quiet tenant's (and high priority's) requests/s")
    ap.add_argument("--flood-factor", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per scenario per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--give-up", type=float, default=30.0, help="a measured request waiting longer is aborted")
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--no-priority", action="store_true", help="only the quiet tenant's scenarios (fair share)")
    ap.add_argument("--flood-unique", type=int, default=32, help="tokens of each flood prompt after the system prompt")
    ap.add_argument("--before", action="store_true", help="also fair share as first shipped (see whole_steps)")
    args = ap.parse_args()
    model = make_random_model(
        Path(tempfile.mkdtemp()) / "m",
        layers=args.layers,
        hidden=args.hidden,
        heads=8,
        kv_heads=2,
        intermediate=3 * args.hidden,
        vocab=512,
        context=4096,
    )
    settings = dict(
        model=model,
        dtype="float32",
        page_size=16,
        max_total_tokens=32768,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    quiet_rate, flood_rate = args.rate, args.rate * args.flood_factor

    def quiet_prompt(seed: int) -> Any:
        """Random prompts, different in every scenario and round: the measured requests never hit the cache."""
        return lambda i: random.Random(seed * 100_003 + i).choices(range(3, 512), k=128)

    def flood_prompt(i: int) -> list[int]:
        return SYSTEM + [(i * 37 + k) % 500 + 3 for k in range(args.flood_unique)]

    results: dict[str, list[float]] = {}
    works: dict[str, list[tuple[int, int, int]]] = {}
    gave_up: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        on = stack.enter_context(Engine(**settings, fair_share=True))
        off = stack.enter_context(Engine(**settings, fair_share=False))
        engines = [on, off]
        if args.before:  # a third engine only when its scenario runs
            before = stack.enter_context(Engine(**settings, fair_share=True))
            whole_steps(before)
            engines.append(before)
        for eng in engines:  # warm up and cache the system prompt
            eng.generate(input_ids=flood_prompt(0), sampling_params={"max_new_tokens": 4})
        logs = {id(eng): StepLog(eng) for eng in engines}
        for rnd in range(args.rounds):
            seed = 1000 * rnd
            cases = {
                "quiet alone": (on, None, 0),
                "quiet + flood, fair share on": (on, "flood", 0),
                **({"quiet + flood, fair share on, whole steps (before)": (before, "flood", 0)} if args.before else {}),
                "quiet + flood, fair share off": (off, "flood", 0),
                "high priority, unloaded": (off, None, 1),
                "high priority + low-priority flood": (off, "low", 1),
            }
            for k, (name, (eng, flood_kind, prio)) in enumerate(cases.items()):
                if args.no_priority and prio:
                    continue
                measured = Load(
                    eng,
                    quiet_rate,
                    "quiet" if prio == 0 else "flood",
                    quiet_prompt(seed + k + 1),
                    16,
                    priority=prio,
                    give_up=args.give_up,
                    steps=logs[id(eng)],
                )
                flood = None if flood_kind is None else Load(eng, flood_rate, "flood", flood_prompt, 32, priority=0)
                asyncio.run(scenario(measured, flood, args.duration, seed))
                results.setdefault(name, []).extend(measured.ttfts)
                works.setdefault(name, []).extend(measured.works())
                gave_up[name] = gave_up.get(name, 0) + measured.gave_up
                load = " ".join(f"{x:.1f}" for x in os.getloadavg())
                print(
                    f"round {rnd + 1} {name}: n={len(measured.ttfts)} p95 {p95(measured.ttfts):.3f} s, "
                    f"load average {load}",
                    flush=True,
                )
    print(f"\nmachine: {machine()}")
    print(
        f"flags: {json.dumps({k: str(v) for k, v in settings.items() if k != 'model'})}, {args.layers} layers "
        f"hidden {args.hidden}, quiet {quiet_rate}/s, flood {flood_rate}/s, {args.duration:g} s x {args.rounds} rounds\n"
    )
    print("| scenario | requests | TTFT p50 s | TTFT p95 s | gave up | tokens run before the first token p50 / p95 |")
    print("|---|---|---|---|---|---|")
    for name, xs in results.items():
        w = [t[0] for t in works[name]] or [0]
        print(
            f"| {name} | {len(xs)} | {np.percentile(xs, 50):.3f} | {p95(xs):.3f} | {gave_up[name]} | "
            f"{np.percentile(w, 50):.0f} / {np.percentile(w, 95):.0f} |"
        )
    print("\nWhat the slowest 10% (by work) waited for, mean tokens: the flood's prefill / decodes / the rest")
    for name, ws in works.items():
        print(f"- {name}: " + " / ".join(f"{x:.0f}" for x in slowest_tenth(ws)))
    alone, fair, unfair = (
        p95(results[k]) for k in ("quiet alone", "quiet + flood, fair share on", "quiet + flood, fair share off")
    )
    print(
        f"\nquiet p95 with fair share on / alone: {fair / alone:.2f}x (goal <= 2); off / alone: {unfair / alone:.2f}x"
    )
    w = {k: float(np.percentile([t[0] for t in v] or [0], 95)) for k, v in works.items()}
    print(
        f"work before the first token, p95 ratios: fair on / alone "
        f"{w['quiet + flood, fair share on'] / w['quiet alone']:.2f}x, off / alone "
        f"{w['quiet + flood, fair share off'] / w['quiet alone']:.2f}x (of those that got a token)"
    )
    if args.before:
        name = "quiet + flood, fair share on, whole steps (before)"
        print(
            f"before: quiet p95 / alone {p95(results[name]) / alone:.2f}x wall, {w[name] / w['quiet alone']:.2f}x work"
        )
    if not args.no_priority:
        hi0, hi = p95(results["high priority, unloaded"]), p95(results["high priority + low-priority flood"])
        print(f"high-priority p95 under the flood / unloaded: {hi / hi0:.2f}x (goal <= 1.5)")
        hw = w["high priority + low-priority flood"] / w["high priority, unloaded"]
        print(f"work before the first token, p95 ratio: high priority flood / unloaded {hw:.2f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "works": works, "gave_up": gave_up, "machine": machine()})
        )


if __name__ == "__main__":
    main()
