"""Speculative decoding end to end through HTTP servers: `radixserve serve --speculative off` against `auto` (the
default), and llama.cpp's llama-server with `--spec-type none` against its n-gram lookup (`--spec-type ngram-simple`,
its defaults), on the same chat requests (benchmarks/spec_workloads.py), all four servers up at once and the runs
interleaved per repetition so the shared machine's noise hits each alike.

Two parts:
- 1 stream: each workload's requests one after another (prompts warmed into every server's cache first);
- 4 streams: four chats sent together, twice: the three copy workloads plus one prose request ("mixed"), and four
  prose requests on different topics ("prose x4", nothing to copy).
Prints end-to-end completion tokens/s (all tokens / wall time) per server and the on/off ratio, with draft tokens
proposed and accepted (radixserve: /cache/stats; llama-server: each response's `timings.draft_n(_accepted)`).

    .venv/bin/python -m benchmarks.speculative_http [--reps 1] [--only W ..] [--llama-workloads W ..] [--skip-llama]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.compare.engines import Server, free_port, launch, llama_server_binary
from benchmarks.spec_workloads import FIRST_TURN, QWEN_DEFAULTS, Messages, Workload, workloads
from radixserve.model.resolve import DEFAULT_GGUF_NAME, default_cache_dir

KV_TOKENS = 16384


@dataclass
class Target:
    """One server under test and the draft counts its responses reported (llama-server) so far."""

    server: Server
    llama: bool
    drafted: int = 0
    accepted: int = 0

    def draft_counts(self) -> tuple[int, int]:
        if not self.llama:  # radixserve_spec_{draft,accepted}_tokens_total{source="..."} in /metrics
            text = httpx.get(self.server.url + "/metrics", timeout=30).text
            counts = {"draft": 0, "accepted": 0}
            for line in text.splitlines():
                for kind in counts:
                    if line.startswith(f"radixserve_spec_{kind}_tokens_total{{"):
                        counts[kind] += int(float(line.rsplit(" ", 1)[1]))
            return counts["draft"], counts["accepted"]
        return self.drafted, self.accepted

    def chat(self, messages: Messages, load: Workload) -> int:
        """Send one chat; the completion tokens it produced."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": load.max_new}
        if self.llama:  # llama-server has no model defaults of its own: the default model's, spelled out
            body |= {**QWEN_DEFAULTS, "temperature": 0} if not load.sampled else QWEN_DEFAULTS
            body |= {"cache_prompt": True}
        else:
            body |= load.params
        r = httpx.post(self.server.url + "/v1/chat/completions", json=body, timeout=1800)
        r.raise_for_status()
        out = r.json()
        timings = out.get("timings") or {}
        self.drafted += timings.get("draft_n", 0)
        self.accepted += timings.get("draft_n_accepted", 0)
        return out["usage"]["completion_tokens"]


def start_all(args: argparse.Namespace, log_dir: Path) -> dict[str, Target]:
    threads = 2
    radix = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--max-total-tokens"]
    llama = [str(args.llama_server), "-m", str(args.gguf), "-np", "4", "-c", str(KV_TOKENS), "-t", str(threads)]
    llama += ["-tb", str(threads), "--host", "127.0.0.1"]
    specs = {
        "radix-off": (radix + [str(KV_TOKENS), "--speculative", "off"], False),
        "radix-auto": (radix + [str(KV_TOKENS), "--speculative", "auto"], False),
    }
    if not args.skip_llama:
        specs["llama-none"] = (llama + ["--spec-type", "none"], True)
        specs["llama-ngram"] = (llama + ["--spec-type", "ngram-simple"], True)
    targets: dict[str, Target] = {}
    try:
        for name, (cmd, is_llama) in specs.items():
            port = free_port()
            targets[name] = Target(launch(name, cmd + ["--port", str(port)], port, threads, log_dir), is_llama)
    except BaseException:
        for t in targets.values():
            t.server.stop()
        raise
    return targets


def timed(target: Target, jobs: list[tuple[Messages, Workload]], streams: int) -> tuple[int, float]:
    """Run `jobs` on `streams` concurrent connections: (completion tokens, wall seconds)."""
    t0 = time.perf_counter()
    if streams == 1:
        tokens = sum(target.chat(m, w) for m, w in jobs)
    else:
        with ThreadPoolExecutor(streams) as pool:
            tokens = sum(pool.map(lambda job: target.chat(*job), jobs))
    return tokens, time.perf_counter() - t0


def compare(
    targets: dict[str, Target], label: str, jobs: list[tuple[Messages, Workload]], streams: int, reps: int
) -> None:
    """One row per pair (off/on): tokens/s of each, the ratio, the drafts proposed and accepted."""
    for target in targets.values():  # warm every prompt into every server's cache
        for messages, load in jobs:
            target.chat(messages, Workload(load.name, [], 1, {"temperature": 0}))
    totals = {name: [0, 0.0] for name in targets}
    before = {name: t.draft_counts() for name, t in targets.items()}
    names = list(targets)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            tokens, wall = timed(targets[name], jobs, streams)
            totals[name][0] += tokens
            totals[name][1] += wall
    for off, on in (("radix-off", "radix-auto"), ("llama-none", "llama-ngram")):
        if off not in targets:
            continue
        tps = {n: totals[n][0] / totals[n][1] for n in (off, on)}
        drafted, accepted = (x - y for x, y in zip(targets[on].draft_counts(), before[on]))
        rate = f"{accepted / drafted:.0%} ({accepted}/{drafted})" if drafted else "no drafts"
        print(
            f"| {label} | {streams} | {off} / {on} | {totals[off][0]} / {totals[on][0]} | {tps[off]:.1f} | "
            f"{tps[on]:.1f} | {tps[on] / tps[off]:.2f}x | {rate} | {os.getloadavg()[0]:.1f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--llama-server", type=Path, default=llama_server_binary(), help="default: as benchmarks.compare's")
    ap.add_argument("--gguf", type=Path, default=default_cache_dir() / DEFAULT_GGUF_NAME)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="1-stream workloads to run (default: all)")
    ap.add_argument(
        "--llama-workloads",
        nargs="*",
        default=["code-edit", "multi-turn", "rag"],
        help="1-stream workloads llama-server runs too (it decodes several times slower on a loaded machine)",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/speculative_http"))
    a = ap.parse_args()
    if a.llama_server is None and not a.skip_llama:
        ap.error("no llama-server: scripts/install_peers.sh, $LLAMA_SERVER or --llama-server (or --skip-llama)")
    targets = start_all(a, a.log_dir)
    try:
        answer = httpx.post(  # the multi-turn workload's first answer, as the in-process benchmark makes it
            targets["radix-off"].server.url + "/v1/chat/completions",
            json={"messages": FIRST_TURN, "max_tokens": 200, "temperature": 0},
            timeout=600,
        ).json()["choices"][0]["message"]["content"]
        loads = {w.name: w for w in workloads(lambda _: answer)}
        print(
            "| workload | streams | servers (off / on) | tokens (off / on) | tok/s off | on | ratio | drafts accepted | load |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        radix_only = {n: t for n, t in targets.items() if not t.llama}
        for load in loads.values():
            if not a.only or load.name in a.only:
                which = targets if load.name in a.llama_workloads else radix_only
                compare(which, load.name, [(m, load) for m in load.requests], 1, a.reps)
        prose = loads["prose-sampled"]
        mixed = [(loads[n].requests[0], loads[n]) for n in ("code-edit", "multi-turn", "rag")] + [
            (prose.requests[0], prose)
        ]
        compare(targets, "mixed (code-edit, multi-turn, rag, prose)", mixed, 4, a.reps)
        compare(targets, "prose x4 (sampled)", [(m, prose) for m in prose.requests[:4]], 4, a.reps)
    finally:
        for t in targets.values():
            t.server.stop()


if __name__ == "__main__":
    main()
