"""The typed request path: GenerateRequest in, GenerateOutput / StreamChunk out, the dict API built from them."""

from __future__ import annotations

import asyncio

import msgspec

from radixserve import FinishReason, GenerateOutput, GenerateRequest, StreamChunk
from radixserve.io import OutputMeta


def _meta(**kw: object) -> OutputMeta:
    base = dict(
        id="r", prompt_tokens=3, completion_tokens=2, cached_tokens=0, finish_reason=None, ttft=None, e2e_latency=0.5
    )
    return OutputMeta(**{**base, **kw})  # type: ignore[arg-type]


def test_output_encodes_to_the_documented_json_shape() -> None:
    out = GenerateOutput("hi", [1, 2], _meta(finish_reason=FinishReason("stop", 2), ttft=0.1))
    as_json = msgspec.json.decode(msgspec.json.encode(out))
    assert as_json == {
        "text": "hi",
        "output_ids": [1, 2],
        "meta_info": {
            "id": "r",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "finish_reason": {"type": "stop", "matched": 2},
            "ttft": 0.1,
            "e2e_latency": 0.5,
        },
    }
    assert out.to_dict() == as_json


def test_unfinished_chunk_keeps_null_finish_reason_and_ttft_and_omits_unasked_logprobs() -> None:
    chunk = StreamChunk("", [], _meta())
    meta = msgspec.json.decode(msgspec.json.encode(chunk))["meta_info"]
    assert meta["finish_reason"] is None and meta["ttft"] is None
    assert "output_token_logprobs" not in meta
    assert not chunk.finished


def test_abort_reason_carries_its_message() -> None:
    assert FinishReason("abort", None, "aborted").to_dict() == {"type": "abort", "matched": None, "message": "aborted"}


def test_engine_typed_and_dict_api_agree(make_engine, tiny_model_dir) -> None:  # noqa: ANN001
    tiny_engine = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    req = GenerateRequest(input_ids=[1, 5, 9, 4], sampling_params={"max_new_tokens": 6, "temperature": 0})
    [typed] = asyncio.run(tiny_engine.run(req))
    assert isinstance(typed, GenerateOutput) and typed.finished
    as_dict = tiny_engine.generate(input_ids=[1, 5, 9, 4], sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert as_dict["output_ids"] == typed.output_ids
    assert as_dict["meta_info"]["finish_reason"] == typed.finish_reason.to_dict()

    async def stream() -> list[StreamChunk]:
        return [c async for c in tiny_engine.stream(req)]

    chunks = asyncio.run(stream())
    assert all(isinstance(c, StreamChunk) for c in chunks) and chunks[-1].finished
    assert [t for c in chunks for t in c.output_ids] == typed.output_ids


def test_engine_generate_shows_the_request_fields_in_its_signature() -> None:
    """generate/async_generate forward to GenerateRequest; help() and editors still list its fields."""
    import dataclasses
    import inspect

    from radixserve.engine import Engine

    fields = [f.name for f in dataclasses.fields(GenerateRequest)]
    assert list(inspect.signature(Engine.generate).parameters) == ["self", *fields]
    params = inspect.signature(Engine.async_generate).parameters
    assert list(params) == ["self", *fields, "stream"] and params["stream"].kind is inspect.Parameter.KEYWORD_ONLY
