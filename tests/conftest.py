"""Shared fixtures: tiny Hugging Face model folders (random weights + a tiny BPE tokenizer), built once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see radixserve/__init__.py
# The GGUF linears' integer kernels on every CPU, as on the ones without AMX: the suite's bit-for-bit checks of GGUF
# models rest on them (row-invariant). The dense path AMX CPUs take from 64 rows has its own tests, which set this
# (tests/test_gguf_dense.py); servers the tests start inherit it.
os.environ.setdefault("RADIXSERVE_GGUF_DENSE_ROWS", "0")
import torch  # noqa: E402

# Triton kernels run in the interpreter on a machine without a GPU; it must be chosen before any kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from engine_checks import assert_at_rest  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402
from tiny_tokenizer import build_tokenizer  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(arch="qwen2", **overrides) -> a folder with config.json, model.safetensors, tokenizer files (cached)."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "qwen2", **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(out, arch, **overrides)
            build_tokenizer(out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny model: Qwen2 architecture (QKV bias, tied embeddings), vocab 512, context 1024."""
    return tiny_model_factory("qwen2")


@pytest.fixture
def make_engine() -> Iterator[Callable[..., object]]:
    """Build engines for a test; at the end each must be at rest with no page leaked, and a flush frees everything."""
    from radixserve import Engine

    engines: list[Engine] = []

    def make(model: Path, **kw: object) -> Engine:
        kw.setdefault("dtype", "float32")
        eng = Engine(model=model, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        try:
            if eng.is_alive():
                assert_at_rest(eng)
        finally:
            eng.shutdown()
