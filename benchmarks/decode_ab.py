"""Decode tokens/s at one stream of radixserve and llama-server, both serving at once, in alternating rounds.

Why beside `benchmarks.compare`: the compare measures each engine once, one after the other, so on a shared host a
slow minute lands on one engine only (its decode figure swung 0.97-1.20x between invocations minutes apart, issue
38). Here both servers are up together and idle between requests; each round measures one then the other (the order
flips every round) with the compare's own measure (`benchmarks.compare.micro`: 32-token prompts, the wall time of
`--tokens` tokens less that of one token, the same client), so a ratio is taken within a round and the rounds'
median is the figure.

    LLAMA_SERVER=.peers/bin/llama-server .venv/bin/python -m benchmarks.decode_ab [--rounds 6] [--tokens 128]
        [--radix-args "--speculative off"] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import tempfile
from pathlib import Path

from benchmarks.compare import engines as eng
from benchmarks.compare.__main__ import default_models
from benchmarks.compare.micro import _batch_wall
from benchmarks.compare.workloads import distinct_prompts
from benchmarks.quant_engine import cpu_flags


def decode_rate(url: str, tok: object, batch: int, tokens: int, seed: int) -> float:
    """Tokens/s of `batch` fresh greedy streams (as benchmarks.compare.micro; fresh prompts each call)."""
    wall_1, _ = _batch_wall(url, distinct_prompts(tok, batch, 32, seed=seed), 1)
    wall_n, results = _batch_wall(url, distinct_prompts(tok, batch, 32, seed=seed + 1), tokens)
    if any(r.completion_tokens != tokens for r in results):
        raise RuntimeError(f"asked {tokens} tokens per request, got {[r.completion_tokens for r in results]}")
    return batch * (tokens - 1) / max(wall_n - wall_1, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--radix-args", default="--speculative off")
    a = ap.parse_args()
    from radixserve.tokenizer import Tokenizer

    gguf, hf_dir = default_models()
    models = eng.Models(gguf, hf_dir, radix_args=tuple(shlex.split(a.radix_args)))
    tok = Tokenizer.from_dir(hf_dir)
    print(cpu_flags(), f"load {os.getloadavg()[0]:.1f}; radix args {a.radix_args!r}; batch {a.batch}")
    with tempfile.TemporaryDirectory() as logs:
        servers = {e: eng.start(e, models, Path(logs)) for e in ("radix", "llama")}
        try:
            ratios = []
            print("| round | radix tok/s | llama tok/s | ratio | load |\n|---|---|---|---|---|")
            for r in range(a.rounds):
                order = ("radix", "llama") if r % 2 == 0 else ("llama", "radix")
                rate = {e: decode_rate(servers[e].url, tok, a.batch, a.tokens, seed=1000 + 10 * r) for e in order}
                ratios.append(rate["radix"] / rate["llama"])
                print(
                    f"| {r} | {rate['radix']:.1f} | {rate['llama']:.1f} | {ratios[-1]:.2f} | {os.getloadavg()[0]:.1f} |"
                )
            print(f"median ratio {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
        finally:
            for s in servers.values():
                s.stop()


if __name__ == "__main__":
    main()
