"""Deterministic mode (issue 39) with `--attention-backend triton`, on CPU under the Triton interpreter: the extend
kernel's batch-invariant variant gives every token the same bits whether its prompt ran in one chunk or many, was
cached, was decoded token by token, or shared its steps with other requests; then the engine on the tiny
checkpoint at the default CPU dtype and quantization gives the same tokens and logprobs alone, in a batch of 8,
from whole cached pages and a partial page, in chunks of 64, and with n-gram speculation (greedy only: see
`greedy`). Shapes stay small: the interpreter is slow."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import radixserve_kernels.cpu as cpu_kernels
from deterministic_checks import DEFAULTS, GREEDY, Answer, answers, others, target_prompt

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.skipif(cpu_kernels.ops() is None, reason="deterministic mode needs the CPU kernels"),
]

# Without a GPU, conftest.py has set TRITON_INTERPRET=1 before any kernel is imported.
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402

PAGE, KV_HEADS, GROUP, DIM, LENGTH = 16, 2, 7, 64, 45  # the default model's GQA ratio 7; 2 pages and 13 rows


def run_steps(steps: list[list[tuple[int, int, int]]], deterministic: bool) -> dict[int, torch.Tensor]:
    """Attention output of every token of requests 0 .. 3, run as `steps` of (request, first, end) token ranges.

    Token t of request r has fixed q/k/v (seeded by r and t), and each request its own shuffled pages, so the only
    differences between two schedules are the steps' shapes. Returns request -> `[tokens, heads, dim]`."""
    pool = KVPool(1, 24, PAGE, KV_HEADS, DIM, torch.bfloat16, "cpu")
    pages = (torch.randperm(23, generator=torch.Generator().manual_seed(len(steps))) + 1).tolist()
    tables = {r: pages[5 * r : 5 * r + 5] for r in range(4)}
    backend = TritonAttentionBackend(pool, KV_HEADS * GROUP, DIM)
    backend.deterministic = deterministic
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in range(4)}
    for step in steps:
        batch = ForwardBatch.build(
            [list(range(a, b)) for _, a, b in step], [a for _, a, _ in step], [tables[r] for r, _, _ in step], PAGE, [0]
        )
        backend.plan(batch)
        q, k, v = (torch.cat([token_rows(r, a, b, which) for r, a, b in step]) for which in range(3))
        out = backend.forward(0, q, k, v)
        for (r, a, b), rows in zip(step, out.split([b - a for _, a, b in step])):
            outs[r].append(rows)
    return {r: torch.cat(o) for r, o in outs.items() if o}


def token_rows(req: int, first: int, end: int, which: int) -> torch.Tensor:
    """q (which 0), k (1) or v (2) of tokens first .. end - 1 of request `req`, the same in every schedule."""
    heads = KV_HEADS * GROUP if which == 0 else KV_HEADS
    rows = [
        torch.randn(heads, DIM, generator=torch.Generator().manual_seed(req * 10007 + t * 3 + which))
        for t in range(first, end)
    ]
    return torch.stack(rows).to(torch.bfloat16)


def schedules() -> dict[str, list[list[tuple[int, int, int]]]]:
    """Request 0's LENGTH tokens: in one chunk; in chunks of 13 (a cache hit's prefix is the same as an earlier
    chunk's); one token a step after 37; and in chunks of 20 beside other requests' prefill and decode tokens."""
    return {
        "one chunk": [[(0, 0, LENGTH)]],
        "chunks of 13": [[(0, a, min(a + 13, LENGTH))] for a in range(0, LENGTH, 13)],
        "decode": [[(0, 0, 37)]] + [[(0, t, t + 1)] for t in range(37, LENGTH)],
        "batched": [
            [(1, 0, 30), (0, 0, 20), (2, 0, 1)],
            [(2, 1, 2), (0, 20, 40), (3, 0, 50), (1, 30, 31)],
            [(1, 31, 32), (0, 40, LENGTH)],
        ],
    }


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_tokens_attention_does_not_depend_on_the_schedule(deterministic: bool) -> None:
    """Bit for bit in deterministic mode; the control, the default kernels (split at the chunk's start, and the
    decode kernel), must differ somewhere, or this test could not fail."""
    runs = {name: run_steps(steps, deterministic)[0] for name, steps in schedules().items()}
    same = [torch.equal(out, runs["one chunk"]) for out in runs.values()]
    assert all(same) if deterministic else not all(same), dict(zip(runs, same))


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    """Qwen2 with the default model's GQA ratio (14 query heads over 2 KV heads): 7 rows per KV head."""
    return tiny_model_factory("qwen2", num_attention_heads=14, num_key_value_heads=2)


TRITON = dict(DEFAULTS, attention_backend="triton", deterministic=True, speculative="off")


def greedy(eng: Any, batch: list[list[int]], at: int) -> Answer:
    """The target's greedy answer at index `at` of `batch`. Greedy only, for the interpreter's sake: seeded sampling
    reads the same logits, and tests/test_deterministic.py shows it invariant once they are."""
    return answers(eng, batch[:at] + [target_prompt()] + batch[at:], GREEDY)[at]


@pytest.fixture(scope="module")
def alone(model: Path) -> Answer:
    """The target alone on a fresh engine: chunks of 512, no cache hit."""
    from radixserve import Engine

    eng = Engine(model=model, **TRITON)
    try:
        assert eng.model_info()["deterministic"] is True
        return greedy(eng, [], 0)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_same_answer_in_a_batch_of_8_and_in_chunks_of_64(model: Path, alone: Answer, make_engine: Callable) -> None:
    eng = make_engine(model, chunked_prefill_size=64, **TRITON)
    assert greedy(eng, others(7), 3) == alone


@pytest.mark.slow
def test_same_answer_from_whole_cached_pages_and_a_partial_page(
    model: Path, alone: Answer, make_engine: Callable
) -> None:
    eng = make_engine(model, page_size=16, **TRITON)
    target = target_prompt()
    for shared in (128, 133):  # 8 whole pages; then 8 pages and 5 rows of a partial one (copied)
        eng.flush_cache()
        eng.generate(input_ids=target[:shared] + [7, 8, 9], sampling_params={"max_new_tokens": 1})
        before = eng.cache_stats()["hit_tokens"]
        assert greedy(eng, [], 0) == alone
        assert eng.cache_stats()["hit_tokens"] - before >= shared
    assert eng.cache_stats()["partial_page_hit_tokens"] > 0


@pytest.mark.slow
def test_same_answer_with_ngram_speculation(model: Path, alone: Answer, make_engine: Callable) -> None:
    """Verify steps run the same kernel as decode steps here (a decode token is a one-token extend)."""
    eng = make_engine(model, **dict(TRITON, speculative="ngram"))
    assert greedy(eng, [], 0) == alone
    assert eng.cache_stats()["spec_verify_steps"] > 0
