"""kernels/cpu/argmax.cpp (greedy sampling's argmax) against torch.argmax: the same ids on random rows, ties (the
first index wins), NaN (the first NaN), infinities and signed zeros, lengths that are not a multiple of the vector
width, and many rows (split over threads); on this CPU's build and, in a process of their own, the AVX2 and plain
builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.cpu
from radixserve.sampling.sampler import greedy_ids

OPS = kernels.cpu.ops()
pytestmark = pytest.mark.skipif(
    OPS is None, reason="CPU kernels unavailable (no compiler, or RADIXSERVE_CPU_KERNELS=0)"
)


def cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(rows, vocab, generator=gen) for rows, vocab in [(1, 151936), (3, 17), (20, 1000), (1, 1)]]
    ties = torch.randn(4, 333, generator=gen)
    ties[:, [5, 100, 300]] = 9.0  # three equal maxima: the first is the answer
    special = torch.randn(6, 77, generator=gen)
    special[0, 40] = float("nan")
    special[1, [3, 70]] = float("nan")
    special[2, :] = float("-inf")
    special[3, 10], special[3, 60] = float("inf"), float("inf")
    special[4, :] = -1.0
    special[4, 20], special[4, 21] = -0.0, 0.0  # equal under ==: the first
    special[5, 76] = 50.0  # the last entry, past the vector loop
    return [*out, ties, special]


@pytest.mark.parametrize("case", range(len(cases())))
def test_same_ids_as_torch(case: int) -> None:
    logits = cases()[case]
    assert torch.equal(OPS.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))


def test_strided_rows_and_bad_inputs() -> None:
    wide = torch.randn(5, 64)[:, :40]
    assert torch.equal(OPS.argmax_rows(wide), wide.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="vocab > 0"):
        OPS.argmax_rows(torch.empty(2, 0))


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_instruction_sets(march: str) -> None:
    env = {**os.environ, "RADIXSERVE_CPU_MARCH": march}
    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        "not other_instruction",
    ]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
