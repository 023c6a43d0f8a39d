"""The router on one machine: prompt cache hit rate of a multi-turn workload through 2 replicas + router, per policy,
beside one replica alone; and the latency the router adds per request.

Hit rate: C conversations (default 16) x T turns (default 4), all sharing one system prompt; each opens with its own
document (D words, default 150) and a question, and each answer is written back into its conversation before the
next question (as chat clients do), so most of a later turn's prompt is cached only where its earlier turns ran.
Run against (1) one replica directly, (2) the router over two
replicas with each policy. Every replica is its own server process with one torch thread; the router is its own
process; caches are flushed and the router restarted (empty tree) between runs. Hit rate = cached / prompt tokens,
summed from the usage of every answer. Also reported: how the requests split over the two replicas.

Overhead: a stub upstream that answers at once (no model), called directly and through the router in alternation,
with realistic chat bodies (the 16 conversations' 4th-turn messages, so the tree is populated); the added latency is
the router's percentile minus the direct one.

    .venv/bin/python -m benchmarks.router [--model random|PATH] [--conversations 16] [--turns 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.http_load import (
    QUESTIONS,
    REPO,
    SYSTEM,
    Report,
    Turn,
    free_port,
    pct,
    resolve_model_arg,
    start_server,
    warm_up_server,
)

WORDS = (
    "cache page token prefix tree worker router replica batch decode prefill kernel tensor stream queue "
    "latency memory block hash model layer head vector scale"
).split()

STUB = """
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
import uvicorn, sys
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'\\
       b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
async def chat(request):
    await request.body()
    return Response(BODY, media_type="application/json")
async def health(request):
    return Response(status_code=200)
app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def wait_up(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up")


def start_router(workers: list[str], policy: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.cli", "route", "--port", str(port), "--policy", policy] + extra
    for w in workers:
        cmd += ["--worker", w]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "router")
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def flush(urls: list[str]) -> None:
    for u in urls:
        httpx.post(u + "/flush_cache", timeout=60).raise_for_status()


def document(conv: int, words: int) -> str:
    """Conversation conv's own text (deterministic): what its later turns can only find in its own worker's cache."""
    rng = random.Random(conv)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def conversation(client: httpx.AsyncClient, conv: int, args: argparse.Namespace, out: list[Turn]) -> None:
    """T turns, streamed; each answer goes back into the conversation as clients do."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Read this document ({conv}): {document(conv, args.doc_words)}\n"
            + QUESTIONS[conv % len(QUESTIONS)],
        },
    ]
    for turn in range(args.turns):
        body = {
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft, answer, usage = None, [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        answer.append(choice["delta"]["content"])
        e2e = time.perf_counter() - t0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append(
            Turn(ttft if ttft is not None else e2e, e2e, usage["completion_tokens"], usage["prompt_tokens"], cached)
        )
        messages = messages + [
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": QUESTIONS[(conv + turn + 1) % len(QUESTIONS)]},
        ]


async def run_workload(url: str, args: argparse.Namespace) -> Report:
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        report = Report(0.0)
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, c, args, report.turns) for c in range(args.conversations)))
        report.wall = time.perf_counter() - t0
        return report


def hit_rate_runs(replicas: list[str], args: argparse.Namespace) -> list[tuple[str, dict, str]]:
    rows = []
    flush(replicas)
    one = asyncio.run(run_workload(replicas[0], args)).row()
    rows.append(("1 replica, direct", one, "-"))
    runs = [
        ("cache_aware", []),
        ("cache_aware", ["--balance-abs-threshold", "4"]),
        ("round_robin", []),
        ("least_load", []),
    ]
    for policy, extra in runs:
        flush(replicas)
        proc, url = start_router(replicas, policy, extra)
        try:
            row = asyncio.run(run_workload(url, args)).row()
            split = "/".join(str(w["requests"]) for w in httpx.get(url + "/workers").json()["workers"])
        finally:
            stop(proc)
        rows.append((f"2 replicas + router, {policy} {' '.join(extra)}".strip(), row, split))
    return rows


def chat_bodies(n: int) -> list[dict]:
    """The 4th turn of n conversations shaped like the hit-rate workload (answers replaced by fixed text)."""
    bodies = []
    for c in range(n):
        msgs = [{"role": "system", "content": SYSTEM}]
        for t in range(4):
            msgs.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)] + f" (follow-up {t})"})
            msgs.append({"role": "assistant", "content": f"answer {c}.{t}: " + "a plausible answer " * 8})
        bodies.append({"messages": msgs[:-1], "max_tokens": 1})
    return bodies


def overhead(requests: int) -> dict[str, float]:
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    direct_url = f"http://127.0.0.1:{port}"
    try:
        wait_up(direct_url, stub, "stub")
        proc, router_url = start_router([direct_url], "cache_aware", [])
        try:
            bodies = chat_bodies(16)
            times: dict[str, list[float]] = {"direct": [], "router": []}
            with httpx.Client(timeout=30) as client:
                for i in range(requests + 50):  # the first 50 pairs warm connections and code paths
                    for name, url in (("direct", direct_url), ("router", router_url)):
                        t0 = time.perf_counter()
                        client.post(url + "/v1/chat/completions", json=bodies[i % 16]).raise_for_status()
                        if i >= 50:
                            times[name].append(time.perf_counter() - t0)
        finally:
            stop(proc)
    finally:
        stop(stub)
    out = {}
    for name, xs in times.items():
        xs.sort()
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = 1e3 * pct(xs, 50), 1e3 * pct(xs, 99)
    out["added_p50_ms"] = out["router_p50_ms"] - out["direct_p50_ms"]
    out["added_p99_ms"] = out["router_p99_ms"] - out["direct_p99_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random", help="HF folder, .gguf, 'random' (8 layers, hidden 512), or default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--doc-words", type=int, default=150, help="words of each conversation's own document (0: none)")
    ap.add_argument("--overhead-requests", type=int, default=1000)
    ap.add_argument("--skip-hit-rate", action="store_true")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}")

    ov = overhead(args.overhead_requests)
    print(
        f"router overhead over {args.overhead_requests} requests (stub upstream, 4th-turn chat bodies): "
        + ", ".join(f"{k} {v:.2f}" for k, v in ov.items())
    )
    if args.skip_hit_rate:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # each replica: one torch thread (the replicas inherit this)
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_arg(None if args.model == "default" else args.model, Path(tmp))
        kwargs = {"model": model, "dtype": args.dtype, "page_size": args.page_size}
        procs, replicas = [], []
        try:
            for _ in range(2):  # one after the other: a port is taken before the next free one is looked up
                port = free_port()
                procs.append(start_server(kwargs, port))
                replicas.append(f"http://127.0.0.1:{port}")
            for u in replicas:
                warm_up_server(u)
            rows = hit_rate_runs(replicas, args)
        finally:
            for p in procs:
                stop(p)
    single = rows[0][1]["hit_rate"]
    print(
        f"workload: {args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens per answer, "
        f"a {args.doc_words}-word document per conversation, model {args.model}, page size {args.page_size}"
    )
    print("| setup | hit rate | vs 1 replica | requests per replica | TTFT p50 ms | TTFT p99 ms | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, row, split in rows:
        print(
            f"| {name} | {row['hit_rate']:.3f} | {row['hit_rate'] / single:.3f} | {split} | "
            f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
