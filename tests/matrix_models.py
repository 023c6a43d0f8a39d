"""The feature matrix's models (benchmarks/matrix.py): a Llama, a Qwen2 with tied embeddings and a Qwen3 with
QK-norm, tiny, random, with the tiny tokenizer; 4 query heads over 2 KV heads, so that `--tp 2` divides them. Each
folder has a GGUF twin beside it (`matrix-<arch>.gguf`, llama.cpp's 32-value block formats) for the rows that run a
GGUF's own blocks."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q

from tiny_models import make_tiny_checkpoint
from tiny_tokenizer import build_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")
# the storage types of the default Q4_K_M file at these row lengths (K-quants need 256-value rows, which the tiny
# models do not have), one per projection so that every block kernel runs
GGUF_TYPES = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q5_0,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q4_0,
    "token_embd": Q.Q5_0,
    "output": Q.Q8_0,
}


def build_models(workdir: Path) -> list[Path]:
    """The three model folders under `workdir`, each with its GGUF twin (built once; reused when already there)."""
    from test_gguf import write_gguf

    paths = []
    for arch in ARCHS:
        out = Path(workdir) / f"matrix-{arch}"
        if not (out / "tokenizer.json").exists():
            make_tiny_checkpoint(out, arch, seed=3)
            build_tokenizer(out)
        if not out.with_suffix(".gguf").exists():
            write_gguf(out.with_suffix(".gguf"), arch, out, GGUF_TYPES, name=f"matrix-{arch}")
        paths.append(out)
    return paths
