"""The feature matrix's models (benchmarks/matrix.py): a Llama, a Qwen2 with tied embeddings and a Qwen3 with
QK-norm, tiny, random, with the tiny tokenizer; 4 query heads over 2 KV heads, so that `--tp 2` divides them."""

from __future__ import annotations

from pathlib import Path

from tiny_models import make_tiny_checkpoint
from tiny_tokenizer import build_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")


def build_models(workdir: Path) -> list[Path]:
    """The three model folders under `workdir` (built once; reused when already there)."""
    paths = []
    for arch in ARCHS:
        out = Path(workdir) / f"matrix-{arch}"
        if not (out / "tokenizer.json").exists():
            make_tiny_checkpoint(out, arch, seed=3)
            build_tokenizer(out)
        paths.append(out)
    return paths
