"""The tiny engine and the bad parameters shared by tests/test_fault_isolation.py and test_fault_isolation_http.py
(one engine per test module, with a queue of 4 so queue accounting is exercised)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_checks import engine_left_at_rest, wait_idle

GREEDY = {"max_new_tokens": 6, "temperature": 0}
PROMPT = [5, 6, 7, 8]

# (sampling params, the field a 400 must name): every value here once passed validation and then killed the loop.
BAD_PARAMS = [
    ({"stop_token_ids": "abc"}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"skip_special_tokens": "x"}, "skip_special_tokens"),
    ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": True, "frequency_penalty": True}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": "3"}, "top_k"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1_000_000_000]}, "stop_token_ids"),
    ({"min_p": True}, "min_p"),
    ({"temperature": True}, "temperature"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"n": 300}, "n"),
    ({"stop": ["x"] * 50_000}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"top_k": 0}, "top_k"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    with engine_left_at_rest(
        tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=2048, max_queued_requests=4
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine: Any) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def break_detokenizer_on_boom(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """Make the detokenizer raise UnicodeError(message) for any request whose stop strings hold "BOOM", on its
    steps and on its final flush (an output that is a stop token alone never steps, but always flushes)."""
    from radixserve.detokenizer import IncrementalDetokenizer

    real_step, real_flush = IncrementalDetokenizer.step, IncrementalDetokenizer.flush

    def faulty_step(self: IncrementalDetokenizer, ids: list[int]) -> Any:
        if "BOOM" in self.stop:
            raise UnicodeError(message)
        return real_step(self, ids)

    def faulty_flush(self: IncrementalDetokenizer) -> str:
        if "BOOM" in self.stop:
            raise UnicodeError(message)
        return real_flush(self)

    monkeypatch.setattr(IncrementalDetokenizer, "step", faulty_step)
    monkeypatch.setattr(IncrementalDetokenizer, "flush", faulty_flush)


def serves_as_before(engine: Any, reference: list[int]) -> None:
    assert engine.is_alive()
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == reference
    wait_idle(engine)
    assert engine._inflight == 0, "the queue counter must return to 0"
