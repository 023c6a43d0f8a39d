"""Figures of one engine on one workload, from the replay client's results; and the workload's best possible hit rate."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.compare.client import Result


def pct(xs: list[float], p: float) -> float:
    """Percentile p (linear interpolation) of xs; NaN when empty."""
    return float(np.percentile(xs, p)) if xs else float("nan")


def prompt_ids(tok: Any, r: Result) -> list[int]:
    """The prompt's token ids as the servers compute them (chat template with generation prompt, or the raw text)."""
    if r.messages is not None:
        return tok.encode(tok.apply_chat_template(r.messages, add_generation_prompt=True), add_special_tokens=False)
    if isinstance(r.prompt, list):
        return list(r.prompt)
    return tok.encode(r.prompt)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def best_hit_tokens(tok: Any, results: list[Result]) -> tuple[int, int]:
    """(prompt tokens an ideal prefix cache serves, prompt tokens) for this run.

    Ideal: every token sequence the engine has seen is kept forever, at token granularity. A prompt can reuse the
    prompts sent before it, and the prompt + answer of requests that ended before it was sent; at least its last
    token is always computed. Answers count as their text re-tokenized (what the next chat turn's prompt holds).
    """
    order = sorted(results, key=lambda r: r.sent)
    seqs = [prompt_ids(tok, r) for r in order]
    answers = [tok.encode(r.text, add_special_tokens=False) if r.text else [] for r in order]
    best = total = 0
    for i, r in enumerate(order):
        seen = 0
        for j in range(i):
            if order[j].end <= r.sent:
                seen = max(seen, common_prefix(seqs[i], seqs[j] + answers[j]))
            else:
                seen = max(seen, common_prefix(seqs[i], seqs[j]))
        best += min(seen, len(seqs[i]) - 1)
        total += len(seqs[i])
    return best, total


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    """TTFT p50/p95 and ITL p50 (ms) over requests that asked for tokens (not prefill-only ones), requests/s, output
    tokens/s, prompt tokens computed versus served from the cache (None where the server does not say), TTFT per tag."""
    gen = [r for r in results if r.max_tokens > 0 and r.completion_tokens > 0]
    ttft = [1e3 * r.ttft for r in gen]
    itl = [1e3 * (r.e2e - r.ttft) / (r.completion_tokens - 1) for r in gen if r.completion_tokens > 1]
    prompt = sum(r.prompt_tokens for r in results)
    known = all(r.cached_tokens is not None for r in results)
    cached = sum(r.cached_tokens or 0 for r in results) if known else None
    by_tag: dict[str, dict[str, float]] = {}
    for tag in dict.fromkeys(r.tag for r in gen):
        xs = [1e3 * r.ttft for r in gen if r.tag == tag]
        by_tag[tag] = {"ttft_p50_ms": pct(xs, 50), "ttft_p95_ms": pct(xs, 95), "requests": len(xs)}
    return {
        "requests": len(results),
        "wall_s": wall,
        "req_s": len(results) / wall,
        "output_tokens": sum(r.completion_tokens for r in results),
        "output_tok_s": sum(r.completion_tokens for r in results) / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p95_ms": pct(ttft, 95),
        "itl_p50_ms": pct(itl, 50),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": None if cached is None else prompt - cached,
        "hit_rate": None if cached is None else cached / max(prompt, 1),
        "by_tag": by_tag,
    }
