"""The example programs in examples/ (SGLang-style programs, only the import differs) run to the end on the tiny
model, each in its own process as a user runs it, and report their cache hit rate."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "common"))
def test_example_runs(name: str, tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("qwen2", max_position_embeddings=4096)  # rag.py's documents need 2k+ tokens
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache hit rate:" in done.stdout
