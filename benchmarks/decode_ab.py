"""Decode tokens/s at one stream of radixserve and llama-server, both serving at once, in alternating rounds.

Why beside `benchmarks.compare`: the compare measures each engine once, one after the other, so on a shared host a
slow minute lands on one engine only (its decode figure swung 0.97-1.20x between invocations minutes apart, issue
38). Here both servers are up together and idle between requests; each round measures one then the other (the order
flips every round) with the compare's own measure (`benchmarks.compare.micro`: 32-token prompts, the wall time of
`--tokens` tokens less that of one token, the same client), so a ratio is taken within a round and the rounds'
median is the figure.

    LLAMA_SERVER=.peers/bin/llama-server .venv/bin/python -m benchmarks.decode_ab [--rounds 6] [--tokens 128]
        [--radix-args "--speculative off"] [--batch 1] [--llama-slots 4] [--variant 4k:RADIXSERVE_HUGE_PAGES=0]
        [--variant-src before:/tmp/wt-before]

`--variant LABEL:NAME=VALUE[,NAME=VALUE]` adds a third server, radixserve with those environment variables, measured
in the same rounds (the order rotates), and reports its ratio to the plain one too. `--variant-src LABEL:DIR` adds
one run from another checkout instead (`git worktree add DIR COMMIT`: two builds side by side; its kernels build
on its first start).
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


def start_with_env(models: eng.Models, logs: Path, env: dict[str, str]) -> eng.Server:
    """radixserve started with `env` added to this process's environment."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return eng.start("radix", models, logs)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--llama-slots",
        type=int,
        default=4,
        help="llama-server's -np (4: issue 38's reference run; below --batch it queues the rest of the streams)",
    )
    ap.add_argument("--radix-args", default="--speculative off")
    ap.add_argument("--variant", help="LABEL:NAME=VALUE[,NAME=VALUE]: a second radixserve with these variables")
    ap.add_argument("--variant-src", help="LABEL:DIR: a second radixserve run from the checkout at DIR")
    a = ap.parse_args()
    from radixserve.tokenizer import Tokenizer

    gguf, hf_dir = default_models()
    models = eng.Models(gguf, hf_dir, radix_args=tuple(shlex.split(a.radix_args)))
    tok = Tokenizer.from_dir(hf_dir)
    print(
        cpu_flags(),
        f"load {os.getloadavg()[0]:.1f}; radix args {a.radix_args!r}; batch {a.batch}; llama slots {a.llama_slots}",
    )
    with tempfile.TemporaryDirectory() as logs:
        servers = {e: eng.start(e, models, Path(logs), parallel=a.llama_slots) for e in ("radix", "llama")}
        if a.variant:
            label, _, assigns = a.variant.partition(":")
            env = dict(kv.split("=", 1) for kv in assigns.split(","))
            servers[label] = start_with_env(models, Path(logs), env)
        if a.variant_src:
            label, _, src = a.variant_src.partition(":")
            servers[label] = eng.start("radix", models, Path(logs), repo=Path(src).resolve())
        names = list(servers)
        pairs = [("radix", "llama")] + [(n, x) for n in names[2:] for x in ("llama", "radix")]
        try:
            ratios: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
            heads = [f"{n} tok/s" for n in names] + [f"{x} / {y}" for x, y in pairs]
            print("| round | " + " | ".join(heads) + " | load |\n|" + "---|" * (len(heads) + 2))
            for r in range(a.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                rate = {e: decode_rate(servers[e].url, tok, a.batch, a.tokens, seed=1000 + 10 * r) for e in order}
                for x, y in pairs:
                    ratios[(x, y)].append(rate[x] / rate[y])
                cells = [f"{rate[n]:.1f}" for n in names] + [f"{ratios[p][-1]:.2f}" for p in pairs]
                print(f"| {r} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.1f} |", flush=True)
            for (x, y), v in ratios.items():
                print(f"{x} / {y}: median {statistics.median(v):.3f} (range {min(v):.2f}-{max(v):.2f})")
        finally:
            for s in servers.values():
                s.stop()


if __name__ == "__main__":
    main()
