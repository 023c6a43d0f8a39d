"""The feature matrix (benchmarks/matrix.py, issue 32): every pair of settings at least once, each combination's
outputs against the reference run's (float32: tokens exactly, logprobs within 1e-4; int8 KV pages: against the
int8-KV reference, tokens exactly, logprobs within 1e-3; retention: against the float32 reference; bf16 with int8
weights or GGUF blocks under --deterministic: tokens and logprobs bit for bit; int8 or GGUF weights without it:
runs cleanly, see the module). The whole product runs with `-m matrix` or
`python -m benchmarks.matrix`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from benchmarks.matrix import FACTORS, LOGPROB_TOL, allowed, compare, pairwise, product, reference_of, run_combo
from benchmarks.matrix import tolerance
from benchmarks.matrix import run_matrix
from matrix_models import build_models

ROWS = pairwise()


def _id(combo: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in combo.items() if v != FACTORS[k][0]) or "reference"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return build_models(tmp_path_factory.mktemp("matrix"))


@pytest.fixture(scope="module")
def references() -> dict:
    return {}  # (reference run id, model) -> its outputs, shared by the rows


def test_the_rows_cover_every_allowed_pair() -> None:
    names = list(FACTORS)
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed({a: va, b: vb}):
                assert any(r[a] == va and r[b] == vb for r in ROWS), (a, va, b, vb)
    assert all(allowed(r) for r in ROWS) and len(ROWS) < len(product())


def test_the_rows_hold_a_deterministic_leg_compared_bit_for_bit() -> None:
    leg = [r for r in ROWS if r["deterministic"]]
    assert leg and all(r["quantization"] in ("int8", "gguf", "gguf-dense") and tolerance(r) == 0.0 for r in leg)
    assert {r["quantization"] for r in leg} >= {"int8", "gguf"}
    assert all(reference_of(r)["deterministic"] for r in leg)
    assert any(r["speculative"] == "ngram" for r in leg) and any(r["page_size"] == 1 for r in leg)


def test_compare_finds_a_changed_token_and_a_logprob_past_the_tolerance() -> None:
    want = {"m": {"p": {"ids": [1, 2], "logprobs": [-1.0, -2.0]}, "n2": [{"ids": [3], "logprobs": [-0.5]}]}}
    assert compare(want, want, LOGPROB_TOL) == []
    token = {"m": {"p": {"ids": [1, 9], "logprobs": [-1.0, -2.0]}, "n2": want["m"]["n2"]}}
    assert len(compare(token, want, LOGPROB_TOL)) == 1
    logprob = {"m": {"p": want["m"]["p"], "n2": [{"ids": [3], "logprobs": [-0.5 + 2 * LOGPROB_TOL]}]}}
    assert "logprob differs" in compare(logprob, want, LOGPROB_TOL)[0]


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[_id(r) for r in ROWS])
def test_every_pair_of_settings_gives_the_reference_tokens(row: int, models: list[Path], references: dict) -> None:
    combo, model = ROWS[row], models[row % len(models)]
    ref = reference_of(combo)
    key = (_id(ref), model.name)
    if key not in references:
        references[key] = run_combo(ref, [model])
    got = run_combo(combo, [model])  # raises if the run failed, leaked a page or broke an invariant
    tol = tolerance(combo)
    diffs = compare(got, references[key], LOGPROB_TOL if tol is None else tol)
    if tol is not None:  # int8 or GGUF without --deterministic: only reported (benchmarks/matrix.py)
        assert not diffs, "\n".join(diffs)


@pytest.mark.matrix
@pytest.mark.slow  # also out of `-m "not slow"`, which replaces the default `-m "not matrix"`
def test_the_whole_product(models: list[Path]) -> None:
    report = run_matrix(product(), models)
    assert not report["failures"], report["failures"]
