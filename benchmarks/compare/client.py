"""The replay client: drives any OpenAI-compatible server with a workload, streaming, and times every request.

A workload is a list of sessions run `concurrency` at a time (closed loop: a session holds its slot until its last
request ends). A session is a list of stages run in order; the steps of a stage are sent together. Chat steps append
their user message to the session's history and write the answer back into it, as real chat clients do.
Per request it records the send time, TTFT (first chunk with text), end time, and the server's token counts
(usage; llama.cpp's `timings` for the prompt tokens it computed versus took from its cache).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Step:
    """One request. Chat: `user` is appended to the session's messages. Completion: `prompt` is sent as is."""

    max_tokens: int
    user: str | None = None
    prompt: str | list[int] | None = None
    tag: str = ""  # e.g. "turn 2", "doc 1": what plots and tables group by


@dataclass
class Session:
    stages: list[list[Step]]
    system: str | None = None  # chat sessions start from this system message


@dataclass
class Result:
    """What one request did, as the client saw it (times in seconds from the workload's start)."""

    session: int
    stage: int
    tag: str
    max_tokens: int
    sent: float
    ttft: float
    end: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # prompt tokens the server served from its cache, when it says
    messages: list[dict[str, str]] | None  # the chat prompt, or None for a completion
    prompt: str | list[int] | None
    text: str

    @property
    def e2e(self) -> float:
        return self.end - self.sent


@dataclass
class Replay:
    url: str
    concurrency: int
    timeout_s: float = 3600.0
    results: list[Result] = field(default_factory=list)

    async def run(self, sessions: list[Session]) -> float:
        """Run every session; returns the wall time in seconds. Results land in self.results."""
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        sem = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits) as client:
            t0 = time.perf_counter()

            async def one(i: int, s: Session) -> None:
                async with sem:
                    await self.session(client, t0, i, s)

            await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
            return time.perf_counter() - t0

    async def session(self, client: httpx.AsyncClient, t0: float, index: int, s: Session) -> None:
        messages = [{"role": "system", "content": s.system}] if s.system is not None else []
        for k, stage in enumerate(s.stages):
            outs = await asyncio.gather(*(self.request(client, t0, index, k, step, messages) for step in stage))
            for step, out in zip(stage, outs):
                if step.user is not None:  # write the answer back: the next turn's prompt holds it
                    messages = messages + [
                        {"role": "user", "content": step.user},
                        {"role": "assistant", "content": out.text},
                    ]
            self.results.extend(outs)

    async def request(
        self, client: httpx.AsyncClient, t0: float, session: int, stage: int, step: Step, history: list[dict[str, str]]
    ) -> Result:
        body: dict[str, Any] = {
            "max_tokens": step.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if step.user is not None:
            path, messages = "/v1/chat/completions", history + [{"role": "user", "content": step.user}]
            body["messages"] = messages
        else:
            path, messages = "/v1/completions", None
            body["prompt"] = step.prompt
        sent = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        timings: dict[str, Any] | None = None
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{self.url}{path}: HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"{self.url}{path} failed mid-stream: {payload[:500]}")
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if messages is not None else choice.get("text")
                    if text:
                        first = first if first is not None else time.perf_counter()
                        pieces.append(text)
        end = time.perf_counter()
        if usage is None:
            raise RuntimeError(f"{self.url}{path} sent no usage (stream_options.include_usage)")
        return Result(
            session,
            stage,
            step.tag,
            step.max_tokens,
            sent - t0,
            (first if first is not None else end) - sent,
            end - t0,
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            cached_tokens(usage, timings),
            messages,
            step.prompt,
            "".join(pieces),
        )


def cached_tokens(usage: dict[str, Any], timings: dict[str, Any] | None) -> int | None:
    """Prompt tokens served from the server's cache: OpenAI's usage field, else llama.cpp's timings.cache_n."""
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    if timings and timings.get("cache_n") is not None:
        return int(timings["cache_n"])
    return None
