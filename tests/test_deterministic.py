"""Deterministic mode (issue 39) on the tiny checkpoints at the default CPU dtype and quantization: one prompt's
tokens and logprobs, greedy and seeded, bit for bit the same alone, inside a batch of 8 and of 48 mixed-length
prompts, with its prefix cached in whole pages or up to a partial page, with chunks of 64 instead of 512, and with
n-gram speculation; then the same comparison without the mode, which must find a difference (else these tests
could not fail)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import radixserve_kernels.cpu as cpu_kernels
from deterministic_checks import DEFAULTS, Answer, others, target_answers, target_prompt
from radixserve.model.quant import Int8Linear

pytestmark = pytest.mark.skipif(cpu_kernels.ops() is None, reason="deterministic mode needs the CPU kernels")


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """Qwen2 (QKV bias, tied head) and Qwen3 (QK-norm)."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def alone(model: Path) -> tuple[Answer, Answer]:
    """The target alone on a fresh deterministic engine: chunks of 512, no cache hit, no speculation."""
    from radixserve import Engine

    eng = Engine(model=model, deterministic=True, speculative="off", **DEFAULTS)
    try:
        return target_answers(eng, [], 0)
    finally:
        eng.shutdown()


def test_rows_of_the_int8_kernel_do_not_depend_on_the_step() -> None:
    torch.manual_seed(0)
    for n, k in ((96, 64), (200, 448)):
        lin = Int8Linear.from_float(torch.randn(n, k), torch.randn(n))
        lin.batch_invariant = True
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(600, k).to(dtype)
            full = lin(x)
            for m in (1, 2, 3, 47, 48, 100):
                assert torch.equal(lin(x[:m]), full[:m]), (n, k, dtype, m)
            assert torch.equal(lin(x[301:302]), full[301:302])


@pytest.mark.parametrize("size", [8, 48])
def test_same_answer_alone_and_in_a_batch(size: int, model: Path, alone: tuple, make_engine: Callable) -> None:
    eng = make_engine(model, deterministic=True, speculative="off", **DEFAULTS)
    assert target_answers(eng, others(size - 1), size // 3) == alone


def test_same_answer_from_whole_cached_pages_and_a_partial_page(
    model: Path, alone: tuple, make_engine: Callable
) -> None:
    eng = make_engine(model, deterministic=True, speculative="off", page_size=16, **DEFAULTS)
    target = target_prompt()
    for shared in (128, 133):  # 8 whole pages; then 8 pages and 5 rows of a partial one (copied)
        eng.flush_cache()
        eng.generate(input_ids=target[:shared] + [7, 8, 9], sampling_params={"max_new_tokens": 1})
        before = eng.cache_stats()
        assert target_answers(eng, [], 0) == alone
        after = eng.cache_stats()
        assert after["hit_tokens"] - before["hit_tokens"] >= shared
    assert after["partial_page_hit_tokens"] > 0, after
    assert target_answers(eng, [], 0) == alone  # all but its last token cached, by the requests just above


def test_same_answer_with_chunks_of_64(model: Path, alone: tuple, make_engine: Callable) -> None:
    eng = make_engine(model, deterministic=True, speculative="off", chunked_prefill_size=64, **DEFAULTS)
    assert target_answers(eng, others(7), 2) == alone


def test_same_answer_with_ngram_speculation(model: Path, alone: tuple, make_engine: Callable) -> None:
    eng = make_engine(model, deterministic=True, speculative="ngram", **DEFAULTS)
    assert target_answers(eng, [], 0) == alone
    assert target_answers(eng, others(7), 5) == alone
    assert eng.cache_stats()["spec_verify_steps"] > 0


def test_without_the_mode_the_batch_changes_the_answer(model: Path, make_engine: Callable) -> None:
    """The control: the default kernels give this prompt other logprobs in a batch of 48 than alone (the int8
    linears take another path from 48 rows on, attention another per chunk), so the tests above can fail."""
    eng = make_engine(model, speculative="off", deterministic=False, **DEFAULTS)
    solo = target_answers(eng, [], 0)[0]
    eng.flush_cache()
    assert target_answers(eng, others(47), 16)[0] != solo


def test_on_by_default_where_measured_refused_where_it_cannot_run(
    tiny_model_dir: Path, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.errors import ParamError
    from radixserve.model import cpu_select

    for kind, on in (("AVX512_BF16", True), ("AMX", False), ("AVX2", False)):
        monkeypatch.setattr(cpu_select, "cpu_kind", lambda kind=kind: kind)
        assert make_engine(tiny_model_dir, **DEFAULTS).model_info()["deterministic"] is on, kind
    assert make_engine(tiny_model_dir, deterministic=True, **DEFAULTS).model_info()["deterministic"] is True  # AVX2
    assert make_engine(tiny_model_dir, dtype="float32").model_info()["deterministic"] is False  # no quantization
    with pytest.raises(ParamError, match="int8 weights"):
        make_engine(tiny_model_dir, dtype="float32", deterministic=True)
    with pytest.raises(ParamError, match="torch or triton attention backend"):
        make_engine(tiny_model_dir, attention_backend="flashinfer", quantization="int8", deterministic=True)


@pytest.mark.parametrize("kv", ["float16", "fp8_e4m3"])
def test_kv_pages_the_cpu_op_cannot_read_turn_the_mode_off_or_are_refused(
    tiny_model_dir: Path, make_engine: Callable, monkeypatch: pytest.MonkeyPatch, kv: str
) -> None:
    """On the torch backend the mode's attention is the C++ decode op, which reads float32, bfloat16 and int8 pages:
    with others, unset it stays off (the engine serves), asked for it is refused at start, not at the first step."""
    from radixserve.errors import ParamError
    from radixserve.model import cpu_select

    monkeypatch.setattr(cpu_select, "cpu_kind", lambda: "AVX512_BF16")  # where the mode is on by default
    eng = make_engine(tiny_model_dir, kv_cache_dtype=kv, **DEFAULTS)
    assert eng.model_info()["deterministic"] is False
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}  # sampled, the end of turn came early at times
    assert len(eng.generate(input_ids=[5, 6, 7], sampling_params=greedy)["output_ids"]) == 3
    with pytest.raises(ParamError, match="KV pages"):
        make_engine(tiny_model_dir, kv_cache_dtype=kv, deterministic=True, **DEFAULTS)


def test_gguf_blocks_give_the_same_answer_batched_chunked_and_cached(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, make_engine: Callable
) -> None:
    """The GGUF's own blocks (issue 38) under the mode: alone, inside a batch of 48 prefilled in chunks of 64, and
    from the cache, bit for bit."""
    from matrix_models import GGUF_TYPES
    from test_gguf import write_gguf

    path = write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", tiny_model_factory("qwen2"), GGUF_TYPES)
    kw = {**DEFAULTS, "quantization": "gguf", "deterministic": True, "speculative": "off", "page_size": 16}
    alone = target_answers(make_engine(path, **kw), [], 0)
    eng = make_engine(path, chunked_prefill_size=64, **kw)
    assert eng.model_info()["deterministic"] is True
    assert target_answers(eng, others(47), 16) == alone
    assert target_answers(eng, [], 0) == alone and eng.cache_stats()["hit_tokens"] > 0
