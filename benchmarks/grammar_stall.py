"""What a grammar bomb costs another client (issue 33): a client streams 300 tokens from a live server while another
sends one grammar of the bomb set (tests/grammar_bombs.py); we report the stream's largest gap between events with
and without the bomb, and how the bomb was answered. The model is a small random one with the default model's
tokenizer (Qwen2.5, 151,936 ids): a grammar's cost grows with the vocabulary, so the tiny test vocabulary hides it.

    python -m benchmarks.grammar_stall [--bombs counted-regex,schema-anyOf-3000] [--baseline-runs 3]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bombs", default=",".join(BOMBS), help="comma-separated names from tests/grammar_bombs.py")
    ap.add_argument("--baseline-runs", type=int, default=3)
    args = ap.parse_args()
    with (
        Engine(model=model_with_real_vocabulary(), dtype="float32", max_total_tokens=8192) as eng,
        BackgroundServer(build_app(eng)) as srv,
    ):
        eng.compile_grammars({"regex": "[a-z]+"})  # the vocabulary's trie: built once per engine, not per bomb
        run(srv.url, None)  # warm-up
        rows = {f"no bomb ({i + 1})": run(srv.url, None) for i in range(args.baseline_runs)}
        for name in args.bombs.split(","):
            field, source = BOMBS[name]
            bomb = {"text": "x", "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, field: source}}
            rows[name] = run(srv.url, bomb)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
    print(
        f"machine: {platform.node()}, CPU {model_name}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {time.strftime('%Y-%m-%d %H:%M')}"
    )
    base = max(r["max_gap_s"] for name, r in rows.items() if name.startswith("no bomb"))
    print(f"baseline: the worst of {args.baseline_runs} runs' largest gaps, {base * 1000:.0f} ms")
    print("| case | stream's largest gap ms | above baseline ms | stream s | bomb answered | in s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        answer = "-" if "abuse_status" not in r else f"{r['abuse_status']} {r['abuse_code'] or ''}".strip()
        took = f"{r['abuse_answer_s']:.3f}" if "abuse_answer_s" in r else "-"
        above = (r["max_gap_s"] - base) * 1000
        print(f"| {name} | {r['max_gap_s'] * 1000:.0f} | {above:+.0f} | {r['stream_s']:.2f} | {answer} | {took} |")


if __name__ == "__main__":
    main()
