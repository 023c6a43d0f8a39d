"""One request must never harm the others (issue 12): strict parameters at every entry point, failures isolated to
their request inside the engine loop, queue accounting that always returns, bounded work per request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_checks import wait_idle
from fault_fixtures import BAD_PARAMS, GREEDY, PROMPT, break_detokenizer_on_boom, serves_as_before
from fault_fixtures import engine, reference  # noqa: F401  (fixtures)
from radixserve.errors import ParamError, QueueFullError, RequestFailedError


@pytest.mark.parametrize("params,field", BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_bad_sampling_params_are_refused_at_the_call(
    engine: Any, reference: list[int], params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ParamError) as err:
        engine.generate(input_ids=PROMPT, sampling_params=params)
    assert err.value.field == field
    serves_as_before(engine, reference)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(input_ids=[[1, 2], 3]), "input_ids"),
        (dict(input_ids=[True, 2]), "input_ids"),
        (dict(input_ids=PROMPT, top_logprobs_num=True), "top_logprobs_num"),
        (dict(input_ids=PROMPT, rid=5), "rid"),
        (dict(prompt="x" * 5_000_000), "prompt"),
    ],
)
def test_bad_request_shapes_are_refused(engine: Any, reference: list[int], kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ParamError) as err:
        engine.generate(sampling_params=GREEDY, **kwargs)
    assert err.value.field == field
    serves_as_before(engine, reference)


def test_queue_places_are_given_back_and_batches_are_all_or_nothing(engine: Any, reference: list[int]) -> None:
    for _ in range(3):  # once leaked a queue place per call, until every request was a 429
        with pytest.raises(ParamError):
            engine.generate(input_ids=PROMPT, sampling_params={"seed": 1.5})
    with pytest.raises(ParamError, match="never fit"):  # n beyond the queue limit can never succeed: not a 429
        engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "n": 5})
    engine._inflight += 3  # three places taken by others: a batch of two must be refused whole
    try:
        with pytest.raises(QueueFullError):
            engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=GREEDY)
        assert engine.metrics()["num_running"] == 0 and engine.metrics()["num_waiting"] == 0
    finally:
        engine._inflight -= 3
    serves_as_before(engine, reference)


def test_a_sampler_fault_fails_its_request_alone(
    engine: Any, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import radixserve.model.runner as runner

    real = runner.sample_ids

    def faulty(logits: Any, infos: list[Any]) -> Any:
        if any(i.params.seed == 666 for i in infos):
            raise RuntimeError("injected sampler fault")
        return real(logits, infos)

    monkeypatch.setattr(runner, "sample_ids", faulty)
    prompts = [PROMPT, [9, 10, 11], PROMPT[:2]]
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    params = [GREEDY, {**GREEDY, "temperature": 0.7, "seed": 666}, GREEDY]
    with pytest.raises(RequestFailedError):
        engine.generate(input_ids=[prompts[0], prompts[1], prompts[2]], sampling_params=params)
    wait_idle(engine)
    # the call raised at the fault and aborted the batch's other requests (wherever they had got to); run them
    # again beside the faulty one, one call each, to read their tokens
    import asyncio

    async def together() -> list[Any]:
        calls = [engine.async_generate(input_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outs = asyncio.run(together())
    assert isinstance(outs[1], RequestFailedError)
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == [alone[0], alone[2]]
    engine.check_invariants()
    serves_as_before(engine, reference)


def test_a_detokenizer_fault_fails_its_request_alone(
    engine: Any, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    break_detokenizer_on_boom(monkeypatch, "injected detokenizer fault")
    import asyncio

    async def together() -> list[Any]:
        calls = [
            engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY),
            engine.async_generate(input_ids=PROMPT, sampling_params={**GREEDY, "stop": ["BOOM"]}),
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    good, bad = asyncio.run(together())
    assert isinstance(bad, RequestFailedError) and good["output_ids"] == reference
    engine.check_invariants()
    serves_as_before(engine, reference)


def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(
    engine: Any, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.runner.forward
    calls = {"n": 0}

    def once(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", once)
    with pytest.raises(RequestFailedError):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    wait_idle(engine)
    engine.check_invariants()
    serves_as_before(engine, reference)  # no half-written page was cached: the same tokens as before

    # Two requests in the failing step: the newer one fails, the older one runs again and gets its own tokens.
    import asyncio

    other = [9, 10, 11, 12, 13]
    alone = engine.generate(input_ids=other, sampling_params=GREEDY)["output_ids"]
    calls["n"] = 0

    async def together() -> list[Any]:
        first = asyncio.ensure_future(engine.async_generate(input_ids=other, sampling_params=GREEDY))
        second = asyncio.ensure_future(engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY))
        return await asyncio.gather(first, second, return_exceptions=True)

    engine.flush_cache()
    first, second = asyncio.run(together())
    if isinstance(first, RequestFailedError):  # both were alone in their steps: the first step held only it
        assert calls["n"] >= 1
    else:
        assert first["output_ids"] == alone
    assert isinstance(second, RequestFailedError) or second["output_ids"] == reference
    assert isinstance(first, RequestFailedError) != isinstance(second, RequestFailedError)
    monkeypatch.undo()
    wait_idle(engine)
    engine.check_invariants()


def test_a_fault_in_every_step_stops_the_engine_cleanly(tiny_model_dir: Path) -> None:
    from radixserve import Engine
    from radixserve.errors import EngineDeadError

    eng = Engine(model=tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=512)
    try:

        def broken(batch: Any) -> Any:
            raise RuntimeError("injected persistent fault")

        eng.runner.forward = broken
        for _ in range(5):
            with pytest.raises((RequestFailedError, EngineDeadError)):
                eng.generate(input_ids=PROMPT, sampling_params=GREEDY)
            if not eng.is_alive():
                break
        deadline = time.monotonic() + 10
        while eng.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.is_alive(), "a fault that repeats every step must stop the engine (health 503)"
    finally:
        eng.shutdown()


SAMPLING_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 2**65),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.lists(st.integers(-2, 600), max_size=3),
    st.lists(st.text(max_size=2), max_size=3),
)
FIELDS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "seed",
    "n",
    "bogus",
]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.dictionaries(st.sampled_from(FIELDS), SAMPLING_VALUES, max_size=4))
def test_any_sampling_dict_is_a_param_error_or_a_result(engine: Any, params: dict[str, Any]) -> None:
    params = {**params, "max_new_tokens": 3} if isinstance(params.get("max_new_tokens"), int) else params
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params=params)
    except ParamError:
        pass
    else:
        for o in out if isinstance(out, list) else [out]:
            assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert engine.is_alive()
