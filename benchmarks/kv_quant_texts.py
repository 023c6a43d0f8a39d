"""Perplexity of the default model with each KV format over several texts, at several prefix lengths (issue 40).

One prompt per text of its first max(--at) tokens, every token scored (`logprob_start_len=0`); the perplexity at
each length in --at is taken over that run's first tokens (a causal model scores a token from those before it
alone, and chunked prefill cuts the same chunks from the start, so a prefix of the long run equals its own run).
A text is `NAME=FILE[+FILE...]`, the files joined by blank lines; `FILE` may be `REV:PATH`, read by `git show`, so a
text can be pinned to a commit. Engines are built one after another (one in memory). Prints one markdown row per
text and the mean change against the first --kv.

    .venv/bin/python -m benchmarks.kv_quant_texts --kv bfloat16 int8 --at 4096 8192 \\
        --text README=222cdb7:README.md SRC=6cadc50:radixserve/scheduler.py+6cadc50:radixserve/engine.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.quality import token_logprobs  # noqa: E402
from radixserve import Engine  # noqa: E402


def read_text(spec: str) -> str:
    """`FILE[+FILE...]`, each a path or `REV:PATH` (read at that commit), joined by blank lines."""
    parts = []
    for f in spec.split("+"):
        if ":" in f:
            parts.append(subprocess.run(["git", "show", f], capture_output=True, text=True, check=True).stdout)
        else:
            parts.append(Path(f).read_text())
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "int8"], help="KV formats; the first is the reference")
    ap.add_argument("--at", type=int, nargs="+", default=[4096, 8192], help="prefix lengths scored")
    ap.add_argument("--text", nargs="+", required=True, metavar="NAME=FILE[+FILE...]")
    a = ap.parse_args()
    texts = dict(t.split("=", 1) for t in a.text)
    n = max(a.at)
    ppl: dict[tuple[str, str, int], float] = {}
    for kv in a.kv:
        with Engine(dtype="bfloat16", quantization="none", kv_cache_dtype=kv, max_total_tokens=n + 512) as eng:
            for name, spec in texts.items():
                t = time.perf_counter()
                ids = eng.tokenizer.encode(read_text(spec), add_special_tokens=False)[:n]
                if len(ids) < n:
                    raise SystemExit(f"{name} holds {len(ids)} tokens, fewer than {n}")
                lps = token_logprobs(eng, ids)
                for m in a.at:
                    ppl[kv, name, m] = math.exp(-sum(lps[: m - 1]) / (m - 1))
                cells = " ".join(f"{m}: {ppl[kv, name, m]:.3f}" for m in a.at)
                print(f"{kv} {name} {cells} ({time.perf_counter() - t:.0f} s)", flush=True)
    ref = a.kv[0]
    cols = [f"{m} {kv}" for m in a.at for kv in a.kv]
    print("| text | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    change = {(kv, m): [] for kv in a.kv[1:] for m in a.at}
    for name in texts:
        cells = []
        for m in a.at:
            for kv in a.kv:
                p = ppl[kv, name, m]
                if kv == ref:
                    cells.append(f"{p:.3f}")
                else:
                    change[kv, m].append(100 * (p / ppl[ref, name, m] - 1))
                    cells.append(f"{p:.3f}, {change[kv, m][-1]:+.2f}%")
        print(f"| {name} | " + " | ".join(cells) + " |")
    means = [f"{sum(change[kv, m]) / len(change[kv, m]):+.2f}%" if kv != ref else "" for m in a.at for kv in a.kv]
    print("| mean change | " + " | ".join(means) + " |")


if __name__ == "__main__":
    main()
