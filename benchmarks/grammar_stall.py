"""What a grammar bomb costs another client (issue 33): a client streams 300 tokens from a live server while another
sends one grammar of the bomb set (tests/grammar_bombs.py); we report the stream's largest gap between events with
and without the bomb, and how the bomb was answered. The model is a small random one with the default model's
tokenizer (Qwen2.5, 151,936 ids): a grammar's cost grows with the vocabulary, so the tiny test vocabulary hides it.

    python -m benchmarks.grammar_stall [--bombs counted-regex,schema-anyOf-3000] [--baseline-runs 3] [--repeats 3]

Each pass starts a fresh engine (nothing cached), so every pass compiles every bomb; the shared machine's own stalls
move single runs by hundreds of ms, so the median of the passes is what to read.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import radixserve_kernels.cpu as cpu_kernels
from benchmarks.gpu.common import TINY, write_random_checkpoint
from benchmarks.stall import run
from radixserve import Engine
from radixserve.model.resolve import resolve_model
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from grammar_bombs import BOMBS  # noqa: E402

VOCAB = 151_936  # Qwen2.5's


def model_with_real_vocabulary() -> Path:
    """A 4-layer random checkpoint whose tokenizer is the default model's (its folder is converted if need be)."""
    source = resolve_model(None)
    out = write_random_checkpoint(
        Path(tempfile.gettempdir()) / "radixserve-grammar-stall",
        {**TINY, "num_hidden_layers": 4, "vocab_size": VOCAB},
        torch.device("cpu"),
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def one_pass(model: Path, names: list[str], baseline_runs: int) -> dict[str, dict[str, Any]]:
    """A fresh engine and server (no grammar cached): the baseline runs, then one run beside each bomb."""
    with (
        Engine(model=model, dtype="float32", max_total_tokens=8192) as eng,
        BackgroundServer(build_app(eng)) as srv,
    ):
        eng.compile_grammars({"regex": "[a-z]+"})  # the vocabulary's trie: built once per engine, not per bomb
        run(srv.url, None)  # warm-up
        rows = {f"no bomb ({i + 1})": run(srv.url, None) for i in range(baseline_runs)}
        for name in names:
            field, source = BOMBS[name]
            bomb = {"text": "x", "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, field: source}}
            rows[name] = run(srv.url, bomb)
    base = max(r["max_gap_s"] for name, r in rows.items() if name.startswith("no bomb"))
    return {"baseline": {"max_gap_s": base}} | {n: r for n, r in rows.items() if not n.startswith("no bomb")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bombs", default=",".join(BOMBS), help="comma-separated names from tests/grammar_bombs.py")
    ap.add_argument("--baseline-runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="passes, each on a fresh engine; the median is reported")
    args = ap.parse_args()
    model = model_with_real_vocabulary()
    passes = [one_pass(model, args.bombs.split(","), args.baseline_runs) for _ in range(args.repeats)]
    print(
        f"machine: {platform.node()}, CPU {cpu_kernels.cpu_model()} {' '.join(cpu_kernels.kind_flags())}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {time.strftime('%Y-%m-%d %H:%M')}, {args.repeats} passes"
    )
    print("| case | largest gap ms, median of passes | above the baseline's median ms | each pass ms | answered |")
    print("|---|---|---|---|---|")
    base = statistics.median(p["baseline"]["max_gap_s"] for p in passes)
    for name in passes[0]:
        gaps = [p[name]["max_gap_s"] for p in passes]
        answers = {
            f"{p[name]['abuse_status']} {p[name]['abuse_code'] or ''}".strip() for p in passes if name != "baseline"
        }
        mid = statistics.median(gaps)
        each = " / ".join(f"{g * 1000:.0f}" for g in gaps)
        print(
            f"| {name} | {mid * 1000:.0f} | {(mid - base) * 1000:+.0f} | {each} | {', '.join(sorted(answers)) or '-'} |"
        )


if __name__ == "__main__":
    main()
