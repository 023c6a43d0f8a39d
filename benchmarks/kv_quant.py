"""Quantized KV pages (issue 40) side by side, per KV dtype, on the default model (Qwen2.5-Coder-0.5B: 24 layers,
2 KV heads of head_dim 64):

- `capacity`: (a) the pages and tokens an engine's pool holds at one --kv-cache-gb budget, per dtype;
- `rag`: (b) a RAG workload whose documents are twice the bfloat16 pool: every document is read once to warm the
  cache, then requests ask about uniformly random documents (document + a question of their own), one at a time;
  the prompt-token hit rate and TTFT p50 / p95 of those requests, bfloat16 KV vs int8 KV at the same budget (two
  engines, taking each request in turn, so both see the same machine load);
- `decode`: (c) decode tokens/s at 1 stream after a `--contexts` prompt (cached after a first run, so each round is
  decode only), the engines alternating A, B, A, B; and the attention op alone per layer at those contexts.

Documents and prompts are random token ids: the hit rate and the timings do not depend on the text. The quality
measures (d) are benchmarks/quality.py's (`--configs bfloat16:none bfloat16:none:int8`).

    .venv/bin/python -m benchmarks.kv_quant capacity [--gb 1]
    .venv/bin/python -m benchmarks.kv_quant rag [--doc 512] [--pool-docs 8] [--requests 48]
    .venv/bin/python -m benchmarks.kv_quant decode [--contexts 4096 16384] [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve_kernels.cpu import cpu_model, kind_flags  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.cache.kv_format import KVFormat  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, HEADS = 24, 2, 64, 14  # the default model's attention shape
DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")


def header() -> None:
    print(f"{cpu_model()}; {' '.join(kind_flags())}; {os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load {os.getloadavg()[0]:.2f}", flush=True)


def capacity(gb: float) -> None:
    """(a): engines with no weights (null model, the default model's shape) sized by the budget alone."""
    print(f"| KV dtype | bytes / token | pages of 16 at {gb} GiB | tokens | vs bfloat16 |")
    print("|---|---|---|---|---|")
    base = None
    for name in DTYPES:
        with Engine(null_model=True, kv_cache_gb=gb, kv_cache_dtype=name, dtype="bfloat16") as eng:
            pool = eng.runner.pool
            tokens = pool.capacity * pool.page_size
        base = base or (tokens if name == "bfloat16" else None)
        ratio = f"{tokens / base:.2f}x" if base else "-"
        print(f"| {name} | {pool.bytes_per_token:,} | {pool.capacity:,} | {tokens:,} | {ratio} |", flush=True)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def rag(doc: int, pool_docs: int, requests: int, seed: int, null_model: bool = False, tokens: tuple = ()) -> None:
    """(b): the budget is `pool_docs` documents of bfloat16 KV; 2 * pool_docs documents are in play. `null_model`:
    engines without weights (fixed logits, no attention), for hit rates alone: they depend on the pool's size and
    the request order, not on the arithmetic; `tokens`: more bfloat16 engines sized to hold that many tokens, the
    pool a KV layout not built would have at the budget."""
    bf16_token = KVFormat("bfloat16").bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM)
    gb = pool_docs * doc * bf16_token / (1 << 30)
    num_docs = 2 * pool_docs
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 150_000) for _ in range(doc)] for _ in range(num_docs)]
    order = [rng.randrange(num_docs) for _ in range(requests)]
    print(f"{num_docs} documents of {doc} tokens; budget {gb * 1024:.1f} MiB = {pool_docs} documents of bfloat16 KV")
    kw = {"speculative": "off", "null_model": null_model} | ({"dtype": "bfloat16"} if null_model else {})
    engines = {n: Engine(kv_cache_gb=gb, kv_cache_dtype=n, **kw) for n in ("bfloat16", "int8")}
    for t in tokens:
        engines[f"{t} tokens"] = Engine(max_total_tokens=t, kv_cache_dtype="bfloat16", **kw)
    try:
        tok = engines["int8"].tokenizer
        params = {"max_new_tokens": 1, "temperature": 0}
        for d in docs:  # warm-up: each document once
            for eng in engines.values():
                eng.generate(
                    input_ids=d + tok.encode("\nQuestion: what is it about?", add_special_tokens=False),
                    sampling_params=params,
                )
        before = {n: eng.cache_stats()["hit_tokens"] for n, eng in engines.items()}
        ttft: dict[str, list[float]] = {n: [] for n in engines}
        prompt_tokens = 0
        for i, d in enumerate(order):  # the engines alternate request by request: the same load on both
            ids = docs[d] + tok.encode(f"\nQuestion {i}: what does it say?", add_special_tokens=False)
            prompt_tokens += len(ids)
            for n, eng in engines.items():
                ttft[n].append(eng.generate(input_ids=ids, sampling_params=params)["meta_info"]["ttft"])
        print("| KV dtype | pool tokens | hit rate | TTFT p50 | TTFT p95 |")
        print("|---|---|---|---|---|")
        rates = {}
        for n, eng in engines.items():
            rates[n] = (eng.cache_stats()["hit_tokens"] - before[n]) / prompt_tokens
            pool_tokens = eng.runner.pool.capacity * eng.runner.pool.page_size
            p50, p95 = _pct(ttft[n], 0.5) * 1e3, _pct(ttft[n], 0.95) * 1e3
            print(f"| {n} | {pool_tokens:,} | {rates[n]:.3f} | {p50:.0f} ms | {p95:.0f} ms |", flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    print(f"hit rate int8 / bfloat16: {rates['int8'] / max(rates['bfloat16'], 1e-9):.2f}x")


def _decode_rate(eng: Engine, prompt: list[int], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    meta = eng.generate(input_ids=prompt, sampling_params=params)["meta_info"]
    return (meta["completion_tokens"] - 1) / (meta["e2e_latency"] - meta["ttft"])


def decode(contexts: list[int], new_tokens: int, rounds: int) -> None:
    """(c): one engine per KV dtype (same weights: the CPU's auto choice), alternating; then the op alone."""
    rng = random.Random(0)
    tokens = max(contexts) + new_tokens + 64
    engines = {n: Engine(kv_cache_dtype=n, max_total_tokens=tokens, speculative="off") for n in ("bfloat16", "int8")}
    try:
        for context in contexts:
            prompt = [rng.randrange(1000, 150_000) for _ in range(context)]
            rates: dict[str, list[float]] = {n: [] for n in engines}
            for n, eng in engines.items():  # the prefill, once: later rounds hit the cached prompt
                t = time.perf_counter()
                _decode_rate(eng, prompt, 2)
                print(f"{n}: prefill of {context} tokens {time.perf_counter() - t:.0f} s", flush=True)
            for _ in range(rounds):
                for n, eng in engines.items():
                    rates[n].append(_decode_rate(eng, prompt, new_tokens))
            med = {n: statistics.median(r) for n, r in rates.items()}
            print(
                f"context {context}: decode bfloat16 KV {med['bfloat16']:.2f} tok/s, int8 KV {med['int8']:.2f} tok/s "
                f"({med['int8'] / med['bfloat16']:.2f}x; rounds {rates}; load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            for eng in engines.values():
                eng.flush_cache()
    finally:
        for eng in engines.values():
            eng.shutdown()
    for context in contexts:
        layer_op(context)


@torch.no_grad()
def layer_op(context: int, iters: int = 50, rounds: int = 5) -> None:
    """The C++ decode op alone on one layer's pages (scattered), bfloat16 vs int8 pages, alternating."""
    import radixserve_kernels.cpu

    ops = radixserve_kernels.cpu.ops()
    ps = 16
    pages = (context + ps - 1) // ps
    table = (torch.randperm(pages) + 1).to(torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    q = torch.randn(1, HEADS, HEAD_DIM).to(torch.bfloat16)
    kv = {}
    for name in ("bfloat16", "int8"):
        fmt = KVFormat(name)
        kv[name] = [fmt.encode(torch.randn(pages + 1, ps, KV_HEADS, HEAD_DIM), kind) for kind in ("k", "v")]
    times: dict[str, list[float]] = {n: [] for n in kv}
    for _ in range(rounds):
        for name, (k, v) in kv.items():
            t = time.perf_counter()
            for _ in range(iters):
                ops.decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5)
            times[name].append((time.perf_counter() - t) / iters * 1e6)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"op alone, context {context}: bfloat16 pages {med['bfloat16']:.0f} us/layer, int8 pages {med['int8']:.0f} "
        f"us/layer ({med['bfloat16'] / med['int8']:.2f}x faster)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("capacity").add_argument("--gb", type=float, default=1.0)
    r = sub.add_parser("rag")
    r.add_argument("--doc", type=int, default=512)
    r.add_argument("--pool-docs", type=int, default=8)
    r.add_argument("--requests", type=int, default=48)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--null-model", action="store_true", help="no weights: hit rates only, TTFT meaningless")
    r.add_argument("--tokens", type=int, nargs="*", default=[], help="also bfloat16 pools of these many tokens")
    d = sub.add_parser("decode")
    d.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--rounds", type=int, default=3)
    args: Any = ap.parse_args()
    header()
    if args.cmd == "capacity":
        capacity(args.gb)
    elif args.cmd == "rag":
        rag(args.doc, args.pool_docs, args.requests, args.seed, args.null_model, tuple(args.tokens))
    else:
        decode(args.contexts, args.new_tokens, args.rounds)


if __name__ == "__main__":
    main()
