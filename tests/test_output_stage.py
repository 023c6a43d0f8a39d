"""The output stage (radixserve/output_stage.py): detokenizing and stop strings off the engine loop's thread.

A stop string spanning tokens ends the answer where it did when the loop matched it itself (ids up to the token that
completes it, text before it, finish_reason stop with the string); a stream never sends text that turns out to be
part of a stop string; the loop finishes the request (pages back, rule 2) before the caller hears of the end; and
no detokenizing happens on the loop's thread."""

from __future__ import annotations

import asyncio
import queue
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from engine_checks import wait_idle
from radixserve.io import FinishReason, StreamChunk
from radixserve.output_stage import OutputStage
from radixserve.request import Req, ReqUpdate
from radixserve.sampling_params import SamplingParams
from radixserve.tokenizer import Tokenizer
from tiny_tokenizer import build_tokenizer

FULL = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def spanning_stop(decode: Any, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of token j-1's text and the start of token j's, found first there in the text;
    returns it and j (the token that completes it)."""
    full = decode(ids)
    for j in range(3, len(ids) - 2):
        before, upto = decode(ids[:j]), decode(ids[: j + 1])
        new = upto[len(before) :]
        if not upto.startswith(before) or len(before) < 2 or not new or "\ufffd" in upto:
            continue
        stop = before[-2:] + new[:1]
        if stop.strip() and full.index(stop) == len(before) - 2:
            return stop, j
    raise AssertionError(f"no stop string spans two tokens in {full!r}")


@pytest.fixture(params=["off", "ngram"])  # one token per step, or several (accepted drafts) that a stop may cut
def answer(
    request: pytest.FixtureRequest, tiny_model_dir: Path, make_engine: Any
) -> tuple[Any, list[int], list[int], str, str, int]:
    eng = make_engine(tiny_model_dir, page_size=4, max_total_tokens=1024, speculative=request.param)
    prompt = [random.Random(13).randrange(3, 500) for _ in range(21)]
    ids = eng.generate(input_ids=prompt, sampling_params=FULL)["output_ids"]
    text = eng.decode(ids)
    stop, j = spanning_stop(eng.decode, ids)
    return eng, prompt, ids, text, stop, j


def test_a_stop_string_spanning_tokens_ends_the_answer_and_frees_its_pages(answer: Any) -> None:
    eng, prompt, ids, text, stop, j = answer
    before = eng.metrics()["generation_tokens_total"]
    out = eng.generate(input_ids=prompt, sampling_params={**FULL, "max_new_tokens": 400 - len(prompt), "stop": [stop]})
    assert out["output_ids"] == ids[: j + 1]  # up to the token that completes it, none after
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["completion_tokens"] == j + 1
    # The loop heard of the stop and finished the request (not at its max_new_tokens, 379): some steps past it (of up
    # to 1 + 8 drafted tokens each with speculation). How many depends on when the output thread runs: the tiny
    # model's steps take about a millisecond, and a CI run on a loaded 2-core machine made 4 where 3 were allowed.
    made = eng.metrics()["generation_tokens_total"] - before
    assert j + 1 <= made <= j + 1 + 16 * (9 if eng.speculative.enabled else 1), made
    wait_idle(eng)
    eng.check_invariants()  # every page is free, cached or held: none leaked by the early finish
    m = eng.metrics()
    assert m["num_running"] == 0 and m["free_pages"] + m["cached_pages"] == m["total_pages"]
    # A finish by stop string caches the answer's KV as any finish does: the next turn hits it.
    turn2 = eng.generate(input_ids=prompt + out["output_ids"] + [7], sampling_params={**FULL, "max_new_tokens": 1})
    assert turn2["meta_info"]["cached_tokens"] >= len(prompt) + j + 1 - 4


def test_a_stream_never_sends_text_of_a_stop_string(answer: Any) -> None:
    eng, prompt, ids, text, stop, j = answer

    async def chunks() -> list[dict[str, Any]]:
        it = eng.async_generate(input_ids=prompt, sampling_params={**FULL, "stop": [stop]}, stream=True)
        return [c async for c in it]

    got = asyncio.run(chunks())
    sent = "".join(c["text"] for c in got)
    assert sent == text[: text.index(stop)]  # the stop's first characters, held back, were never sent
    assert [i for c in got for i in c["output_ids"]] == ids[: j + 1]
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert all(c["meta_info"]["finish_reason"] is None for c in got[:-1])
    # Token j-1's text ends with the stop's first characters: held back, never sent.
    assert eng.decode(ids[:j]).endswith(stop[:2]) and not sent.endswith(stop[:2])
    if not eng.speculative.enabled:  # a chunk per token: the last one (token j) sends nothing
        assert len(got) == j + 1 and got[-1]["text"] == "" and got[-2]["output_ids"] == [ids[j - 1]]


def test_the_loop_thread_never_detokenizes(answer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.detokenizer import IncrementalDetokenizer

    eng, prompt, _, _, stop, _ = answer
    threads: set[str] = set()
    real_step, real_flush = IncrementalDetokenizer.step, IncrementalDetokenizer.flush

    def step(self: IncrementalDetokenizer, new: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real_step(self, new)

    def flush(self: IncrementalDetokenizer) -> str:
        threads.add(threading.current_thread().name)
        return real_flush(self)

    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    monkeypatch.setattr(IncrementalDetokenizer, "flush", flush)
    eng.generate(input_ids=prompt, sampling_params={**FULL, "stop": [stop]})
    eng.generate(input_ids=[prompt, prompt[:9]], sampling_params=FULL)

    async def stream() -> None:
        async for _ in eng.async_generate(input_ids=prompt, sampling_params=FULL, stream=True):
            pass

    asyncio.run(stream())
    assert threads == {"radixserve-output"}
    # and the scheduler's modules do not even import the detokenizer
    code = "import sys, radixserve.scheduler.scheduler, radixserve.engine_loop; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "radixserve.scheduler.scheduler" in loaded and "radixserve.detokenizer" not in loaded


def test_the_stage_tells_the_loop_before_the_caller_and_reports_nothing_after(tmp_path: Path) -> None:
    """Unit test of the stage alone: a request's updates as the loop would send them, the loop's inbox a queue."""
    tok = Tokenizer.from_dir(build_tokenizer(tmp_path))
    ids = tok.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    stop, j = spanning_stop(tok.decode, ids)
    req = Req("r1", [1, 2, 3], SamplingParams(stop=[stop], max_new_tokens=len(ids)), None, stream=True)  # type: ignore[arg-type]
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stage = OutputStage(tok, inbox)
    got: list[tuple[StreamChunk, int]] = []
    stage.open(req, lambda c: got.append((c, inbox.qsize())))  # type: ignore[arg-type]
    try:
        for i, t in enumerate(ids):
            req.output_ids.append(t)  # the loop appends on, not knowing of the stop yet
            last = i == len(ids) - 1
            stage.put([ReqUpdate(req, i + 1, FinishReason("length", None) if last else None)])
    finally:
        stage.stop()
    assert inbox.get_nowait() == ("end", req, FinishReason("stop", stop), None) and inbox.empty()
    chunks = [c for c, _ in got]
    assert got[-1][1] == 1  # the end was in the loop's inbox before the final chunk went out
    assert chunks[-1].finish_reason == FinishReason("stop", stop)  # not the loop's later "length"
    assert [i for c in chunks for i in c.output_ids] == ids[: j + 1]
    text = tok.decode(ids)
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].meta_info.completion_tokens == j + 1


def test_a_fault_at_the_final_output_fails_that_request_alone(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop had finished the request (length) when building its final output failed: its caller gets the error,
    the failure is counted, the other request of the batch is untouched and nothing leaks."""
    from radixserve.detokenizer import IncrementalDetokenizer
    from radixserve.errors import RequestFailedError

    eng = make_engine(tiny_model_dir, page_size=4, max_total_tokens=1024)
    alone = eng.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=FULL)["output_ids"]
    real = IncrementalDetokenizer.flush

    def faulty(self: IncrementalDetokenizer) -> str:
        if "BOOM" in self.stop:
            raise UnicodeError("injected fault at the finish")
        return real(self)

    monkeypatch.setattr(IncrementalDetokenizer, "flush", faulty)
    failed = eng.metrics()["failed_requests_total"]

    async def together() -> list[Any]:
        calls = [
            eng.async_generate(input_ids=[5, 6, 7, 8, 9], sampling_params=FULL),
            eng.async_generate(input_ids=[5, 6, 7, 8, 9], sampling_params={**FULL, "stop": ["BOOM"]}),
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    good, bad = asyncio.run(together())
    assert isinstance(bad, RequestFailedError) and good["output_ids"] == alone
    assert eng.metrics()["failed_requests_total"] == failed + 1
    wait_idle(eng)
    eng.check_invariants()
