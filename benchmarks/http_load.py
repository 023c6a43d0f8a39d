"""Multi-turn chat load over HTTP, and the same workload on the in-process Engine, side by side in one run.

C conversations run concurrently; each has T turns: stream the answer, write it back into the conversation (as real
clients do), ask the next question. All conversations share one system prompt. Greedy with ignore_eos, so both runs
generate the same tokens. Reports TTFT p50/p99 (time to the first visible text), inter-token latency p50/p99 (per
request: (e2e - ttft) / (tokens - 1)), output throughput and the prompt cache hit rate, and the HTTP/in-process ratios.
Use a real model: a random one's tokens are mostly partial UTF-8, whose text only shows at the end.

    .venv/bin/python -m benchmarks.http_load [--model PATH|random] [--conversations 8] [--turns 4] [--max-tokens 32]
    .venv/bin/python -m benchmarks.http_load --url http://127.0.0.1:30000   # an already running server, HTTP only

The HTTP server runs in its own process (`run_server`), so the client's work does not share its interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
SYSTEM = (
    "You are a careful senior engineer. Answer questions about caching, schedulers and tokenizers in a few "
    "sentences, with one concrete example each time. Prefer plain words over jargon, and say when you are unsure. "
    "Never invent an API; if a name is unknown, say so and suggest how to look it up."
)
QUESTIONS = [
    "What is a radix tree, and why would an inference server use one?",
    "How does page size change what a prefix cache can reuse?",
    "When should a scheduler retract a running request?",
    "Why can re-tokenizing a model's answer break a cache hit?",
    "How would you measure time to first token fairly?",
    "What does continuous batching change for the decode step?",
    "Why keep the last partial page private to its request?",
    "How do you evict from a cache without hurting running requests?",
]


@dataclass
class Turn:
    ttft: float
    e2e: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Report:
    wall: float
    turns: list[Turn] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        ttft = sorted(t.ttft for t in self.turns)
        itl = sorted((t.e2e - t.ttft) / (t.completion_tokens - 1) for t in self.turns if t.completion_tokens > 1)
        out_tokens = sum(t.completion_tokens for t in self.turns)
        prompt = sum(t.prompt_tokens for t in self.turns)
        return {
            "ttft_p50_ms": 1e3 * pct(ttft, 50),
            "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50),
            "itl_p99_ms": 1e3 * pct(itl, 99),
            "output_tok_s": out_tokens / self.wall,
            "requests": len(self.turns),
            "wall_s": self.wall,
            "hit_rate": sum(t.cached_tokens for t in self.turns) / max(prompt, 1),
        }


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted xs."""
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


def first_messages(conv: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[conv % len(QUESTIONS)]}]


def next_question(conv: int, turn: int) -> str:
    return QUESTIONS[(conv + turn) % len(QUESTIONS)] + f" (follow-up {turn})"


# ---------------------------------------------------------------- HTTP client


async def http_conversation(
    client: httpx.AsyncClient, conv: int, turns: int, max_tokens: int, model: str | None, out: list[Turn]
) -> None:
    messages = first_messages(conv)
    for turn in range(turns):
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        t0 = time.perf_counter()
        ttft, answer, usage = None, [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = choice["delta"].get("content")
                    if text:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        answer.append(text)
        e2e = time.perf_counter() - t0
        assert usage is not None, "the server sent no usage (stream_options.include_usage)"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append(
            Turn(ttft if ttft is not None else e2e, e2e, usage["completion_tokens"], usage["prompt_tokens"], cached)
        )
        messages = messages + [
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": next_question(conv, turn + 1)},
        ]


async def run_http(url: str, conversations: int, turns: int, max_tokens: int, model: str | None) -> Report:
    limits = httpx.Limits(max_connections=conversations + 4, max_keepalive_connections=conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        report = Report(0.0)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(http_conversation(client, c, turns, max_tokens, model, report.turns) for c in range(conversations))
        )
        report.wall = time.perf_counter() - t0
        return report


# ---------------------------------------------------------------- in-process


async def engine_conversation(eng: Any, builder: Any, conv: int, turns: int, max_tokens: int, out: list[Turn]) -> None:
    messages = first_messages(conv)
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for turn in range(turns):
        t0 = time.perf_counter()
        ids = builder.build(messages, "")  # the same prompt ids the server's chat path sends
        ttft, text, ids_out, meta = None, [], [], None
        async for chunk in eng.async_generate(input_ids=ids, sampling_params=params, stream=True):
            if chunk["text"] and ttft is None:  # first visible text, as the HTTP client measures it
                ttft = time.perf_counter() - t0
            text.append(chunk["text"])
            ids_out += chunk["output_ids"]
            meta = chunk["meta_info"]
        e2e = time.perf_counter() - t0
        answer = "".join(text)
        builder.remember("", answer, ids_out, meta["finish_reason"])
        out.append(
            Turn(
                ttft if ttft is not None else e2e,
                e2e,
                meta["completion_tokens"],
                meta["prompt_tokens"],
                meta["cached_tokens"],
            )
        )
        messages = messages + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next_question(conv, turn + 1)},
        ]


def run_engine(engine_kwargs: dict[str, Any], conversations: int, turns: int, max_tokens: int) -> Report:
    from radixserve import Engine
    from radixserve.server.chat_prompt import ChatPromptBuilder

    with Engine(**engine_kwargs) as eng:
        warm_up_engine(eng)
        builder = ChatPromptBuilder(eng.tokenizer)
        report = Report(0.0)

        async def main() -> None:
            t0 = time.perf_counter()
            await asyncio.gather(
                *(engine_conversation(eng, builder, c, turns, max_tokens, report.turns) for c in range(conversations))
            )
            report.wall = time.perf_counter() - t0

        asyncio.run(main())
        return report


WARM_UP = {"prompt": SYSTEM, "max_tokens": 8}


def warm_up_engine(eng: Any) -> None:
    eng.generate(WARM_UP["prompt"], {"max_new_tokens": WARM_UP["max_tokens"]})
    eng.flush_cache()


# ---------------------------------------------------------------- server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_kwargs: dict[str, Any], port: int) -> subprocess.Popen:
    code = f"from radixserve.server.launch import run_server\nrun_server({engine_kwargs!r}, port={port})\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 1800  # the first start of the default model converts it
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up")
        time.sleep(0.5)


def warm_up_server(url: str) -> None:
    httpx.post(url + "/v1/completions", json=WARM_UP, timeout=600).raise_for_status()
    httpx.post(url + "/flush_cache", timeout=60)


# ---------------------------------------------------------------- main


def resolve_model_arg(model: str | None, tmp: Path) -> str | None:
    if model != "random":
        return model
    sys.path.insert(0, str(REPO))
    from benchmarks.random_model import make_random_model

    # vocab = the tiny tokenizer's, so every sampled id decodes
    return str(
        make_random_model(
            tmp / "random", layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=512, context=8192
        )
    )


def print_table(rows: dict[str, dict[str, float]]) -> None:
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s", "hit_rate", "wall_s", "requests"]
    print("| path | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in rows.items():
        print(
            f"| {name} | "
            + " | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys)
            + " |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder, .gguf, 'random' (a random 8-layer model), or the default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--url", default=None, help="benchmark this running server (HTTP only, no in-process run)")
    ap.add_argument("--served-model", default=None, help="the `model` field to send with --url")
    args = ap.parse_args()

    shape = f"{args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens per answer"
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}")
    if args.url:
        warm_up_server(args.url)
        report = asyncio.run(run_http(args.url, args.conversations, args.turns, args.max_tokens, args.served_model))
        print(f"workload: {shape}, server {args.url}")
        print_table({"http": report.row()})
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_arg(args.model, Path(tmp))
        engine_kwargs = {
            "model": model,
            "dtype": args.dtype,
            "page_size": args.page_size,
            "max_total_tokens": args.max_total_tokens,
        }
        engine = run_engine(engine_kwargs, args.conversations, args.turns, args.max_tokens).row()
        port = free_port()
        proc = start_server(engine_kwargs, port)
        try:
            url = f"http://127.0.0.1:{port}"
            warm_up_server(url)
            http = asyncio.run(run_http(url, args.conversations, args.turns, args.max_tokens, None)).row()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    print(f"workload: {shape}, model {args.model or 'default'}, dtype {args.dtype}, page size {args.page_size}")
    print_table({"engine (in-process)": engine, "http (server process)": http})
    print(
        "HTTP / in-process: "
        + ", ".join(
            f"{k} {http[k] / engine[k]:.2f}x" for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "output_tok_s")
        )
    )


if __name__ == "__main__":
    main()
