"""The disk tier (--kv-cache-dir) on the default model: a RAG workload 4x larger than the KV pool, tier on vs off
(and, with --host-gb, the host-RAM tier alone), and the first request after a restart vs a cold start. Everything
side by side in one run (requests interleaved between the engines), since the machine is shared and noisy.

RAG: `--docs` documents of `--doc-tokens` tokens each (4x the pool of `--pool-tokens`), each request one document
plus a distinct question, asked in `--rounds` shuffled rounds. Hit rate is compared with the unlimited-pool optimum
(every full page of a document seen before hits); TTFT p50 over the requests after the first round.

Restart: a `--system-tokens` system prompt; a cold engine (no tier) vs an engine started on a directory that an
earlier engine wrote at shutdown; both answer the same question greedily and must agree.

    .venv/bin/python -m benchmarks.tiered [--pool-tokens 1024 --docs 8 --doc-tokens 512 --rounds 2 --host-gb 0.1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine

WORDS = (
    "the model reads a page of text and keeps its keys and values so the next request with the same "
    "prefix skips the work documents about rivers trains markets weather history music code tests "
    "servers caches memory disks network latency budget policy schedule"
).split()
QUESTIONS = [
    "Summarize it.",
    "Name one topic.",
    "What is the first word?",
    "Is it long?",
    "Give a title.",
    "List two nouns.",
    "What comes last?",
    "Any numbers?",
]


def text_of(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def exact_tokens(eng: Engine, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += eng.encode(text_of(rng, n))
    return ids[:n]


def ask(eng: Engine, ids: list[int], new_tokens: int) -> dict[str, Any]:
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "temperature": 0})
    return {"ttft": out["meta_info"]["ttft"], "ids": out["output_ids"]}


def optimum_hits(prompts: list[list[int]], page: int) -> int:
    """Hit tokens with an unlimited pool: the longest full-page prefix of each prompt seen before (never all)."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for p in prompts:
        n_pages = (len(p) - 1) // page
        k = 0
        while k < n_pages and tuple(p[: (k + 1) * page]) in seen:
            k += 1
        hits += k * page
        seen.update(tuple(p[: (j + 1) * page]) for j in range(len(p) // page))
    return hits


def rag(args: argparse.Namespace, kv_dir: Path) -> dict[str, Any]:
    common = {"max_total_tokens": args.pool_tokens}
    engines = {"on": Engine(kv_cache_dir=kv_dir, **common), "off": Engine(**common)}
    if args.host_gb:  # the host-RAM tier alone (forced on the CPU), no directory
        engines["host"] = Engine(kv_cache_host_gb=args.host_gb, **common)
    on = engines["on"]
    rng = random.Random(0)
    docs = [exact_tokens(on, rng, args.doc_tokens) for _ in range(args.docs)]
    order = [(r, d) for r in range(args.rounds) for d in rng.sample(range(args.docs), args.docs)]
    prompts = [docs[d] + on.encode(f"\nQuestion {r}: {QUESTIONS[(d + r) % len(QUESTIONS)]}") for r, d in order]
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    same = True
    for i, p in enumerate(prompts):
        outs = {k: ask(eng, p, args.new_tokens) for k, eng in engines.items()}
        same &= all(o["ids"] == outs["off"]["ids"] for o in outs.values())
        if i >= args.docs:  # after the first round: every document was seen once
            for k, o in outs.items():
                ttft[k].append(o["ttft"])
    stats = {k: eng.cache_stats() for k, eng in engines.items()}
    for eng in engines.values():
        eng.shutdown()
    best = optimum_hits(prompts, stats["on"]["page_size"])
    p50 = {k: statistics.median(v) for k, v in ttft.items()}
    s_on = stats["on"]
    out = {
        "requests": len(prompts),
        "pool_tokens": args.pool_tokens,
        "doc_tokens": args.docs * args.doc_tokens,
        "optimum_hit_tokens": best,
        **{f"hit_tokens_{k}": s["hit_tokens"] for k, s in stats.items()},
        **{f"hit_vs_optimum_{k}": s["hit_tokens"] / best for k, s in stats.items()},
        **{f"ttft_p50_{k}": v for k, v in p50.items()},
        **{f"ttft_ratio_{k}": p50[k] / p50["off"] for k in p50 if k != "off"},
        "load_ms_per_page": 1e3 * s_on["load_seconds_per_page"],
        "spilled_pages": s_on["spilled_pages"],
        "loaded_pages": s_on["loaded_pages"],
        "disk_mb": s_on["disk_bytes"] / 1e6,
        "outputs_identical": same,
    }
    if "host" in stats:
        s = stats["host"]
        out.update(
            host_load_ms_per_page=1e3 * s["host_load_seconds_per_page"],
            host_spilled_pages=s["host_spilled_pages"],
            host_loaded_pages=s["host_loaded_pages"],
            host_mb=s["host_bytes"] / 1e6,
        )
    return out


def restart(args: argparse.Namespace, kv_dir: Path) -> dict[str, Any]:
    common = {"max_total_tokens": max(4096, args.system_tokens * 2)}
    writer = Engine(kv_cache_dir=kv_dir, **common)
    system = exact_tokens(writer, random.Random(1), args.system_tokens)
    question = writer.encode("\nUser: what is this about?\nAssistant:")
    warmup = writer.encode("Warm-up: count to three.")
    ask(writer, system + writer.encode("\nUser: hello\nAssistant:"), 1)  # computes the system prompt's pages
    writer.shutdown()  # persists the tree to kv_dir
    cold_t, warm_t, same = [], [], True
    for _ in range(args.restarts):
        cold = Engine(**common)
        ask(cold, warmup, 1)  # both engines warm (threads, allocator) before the measured request
        c = ask(cold, system + question, args.new_tokens)
        cold.shutdown()
        warm = Engine(kv_cache_dir=kv_dir, **common)  # a restart: a new engine on the directory
        ask(warm, warmup, 1)
        w = ask(warm, system + question, args.new_tokens)
        hit = warm.cache_stats()["disk_hit_tokens"]
        warm.shutdown()
        same &= c["ids"] == w["ids"]
        cold_t.append(c["ttft"])
        warm_t.append(w["ttft"])
    return {
        "system_tokens": args.system_tokens,
        "ttft_cold": statistics.median(cold_t),
        "ttft_after_restart": statistics.median(warm_t),
        "ratio": statistics.median(warm_t) / statistics.median(cold_t),
        "disk_hit_tokens": hit,
        "outputs_identical": same,
        "runs": args.restarts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--host-gb", type=float, default=0.0, help="also run the host-RAM tier alone, this size")
    ap.add_argument("--skip", choices=["rag", "restart"], default=None)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip != "rag":
            t0 = time.perf_counter()
            r = rag(args, Path(tmp) / "rag")
            print(
                f"RAG ({time.perf_counter() - t0:.0f} s):",
                {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                flush=True,
            )
        if args.skip != "restart":
            t0 = time.perf_counter()
            r = restart(args, Path(tmp) / "restart")
            print(
                f"restart ({time.perf_counter() - t0:.0f} s):",
                {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                flush=True,
            )


if __name__ == "__main__":
    main()
