"""Constrained decoding on the real default model: every case of tests/data/structured_cases.json (JSON schemas
with nested objects, arrays, enums, bounded numbers, optional fields, string patterns; and regexes), greedy and
sampled, all in one batch, gives output that parses and validates, 100%; unconstrained greedy requests in that
batch get exactly the tokens they get alone; and over HTTP the openai SDK's parse() and a tool-call round trip
(tool_choice auto: the model's own decision), streamed and not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel

from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from real_model import real_engine, real_model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
CASES = json.loads((Path(__file__).parent / "data" / "structured_cases.json").read_text())
MAX_NEW = 96  # every schema bounds its strings and arrays, so a valid output always fits


def _prompt(eng: Any, case: dict) -> list[int]:
    hint = "Reply with JSON only." if case["kind"] == "json_schema" else ""
    if case["kind"] == "regex":
        return eng.encode(case["prompt"] + " ")
    return eng.apply_chat_template([{"role": "user", "content": f"{case['prompt']} {hint}"}])


def _valid(case: dict, text: str) -> bool:
    if case["kind"] == "regex":
        return re.fullmatch(case["grammar"], text) is not None
    return jsonschema_rs.validator_for(case["grammar"]).is_valid(json.loads(text))


def test_every_constrained_output_validates_and_shares_the_batch_harmlessly(real_engine: Any) -> None:  # noqa: F811
    assert len(CASES) >= 30
    free_prompts = [real_engine.encode("def fibonacci(n):"), real_engine.encode("The capital of France is")]
    free = {"max_new_tokens": 16, "temperature": 0.0}
    alone = [real_engine.generate(input_ids=ids, sampling_params=free)["output_ids"] for ids in free_prompts]

    ids, params, which = [], [], []
    for case in CASES:
        for mode, extra in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.8, "seed": 7})):
            ids.append(_prompt(real_engine, case))
            params.append({"max_new_tokens": MAX_NEW, case["kind"]: case["grammar"], **extra})
            which.append((case, mode))
    ids += free_prompts
    params += [free, free]
    outs = real_engine.generate(input_ids=ids, sampling_params=params)

    bad = []
    for (case, mode), out in zip(which, outs):
        try:
            ok = out["meta_info"]["finish_reason"]["type"] == "stop" and _valid(case, out["text"])
        except ValueError:
            ok = False
        if not ok:
            bad.append((case["name"], mode, out["text"], out["meta_info"]["finish_reason"]))
    assert not bad, bad
    assert [o["output_ids"] for o in outs[-2:]] == alone
    assert real_engine.scheduler.stats.forced_tokens > 0  # jump-forward ran


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def client(real_engine: Any) -> Iterator[openai.OpenAI]:  # noqa: F811
    with BackgroundServer(build_app(real_engine)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


class City(BaseModel):
    name: str
    country: str
    population_millions: float


def test_openai_parse_on_the_real_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="default",
        response_format=City,
        max_tokens=60,
        temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and "paris" in city.name.lower()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_on_the_real_model(client: openai.OpenAI, stream: bool) -> None:
    """tool_choice auto: the model decides to call on its own, in its own format; then answers from the result."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kw = dict(model="default", tools=TOOLS, max_tokens=60, temperature=0)
    if stream:
        name, args, call_id, reason = "", "", None, None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            for d in chunk.choices[0].delta.tool_calls or []:
                call_id = call_id or d.id
                name += d.function.name or ""
                args += d.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
    else:
        r = client.chat.completions.create(messages=messages, **kw)
        reason, tc = r.choices[0].finish_reason, r.choices[0].message.tool_calls[0]
        name, args, call_id = tc.function.name, tc.function.arguments, tc.id
    assert reason == "tool_calls" and name == "get_weather" and "paris" in json.loads(args)["city"].lower()
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temperature_c": 21, "sky": "sunny"}'})
    final = client.chat.completions.create(messages=messages, **kw)
    assert final.choices[0].finish_reason == "stop" and "21" in final.choices[0].message.content
    assert final.usage.prompt_tokens_details.cached_tokens > 0  # the tool turn extends the cached conversation


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_parallel_calls_ends_after_the_call_asked_for(client: openai.OpenAI, stream: bool) -> None:
    """Issue 35: with tool_choice required and parallel calls allowed (every agent library's default), the model
    called Paris, London, Berlin, Madrid, ... until max_tokens. Now it may end after any call, and does."""
    kw = dict(model="default", tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    if stream:
        args: dict[int, str] = {}
        reason = None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            for d in chunk.choices[0].delta.tool_calls or []:
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            reason = chunk.choices[0].finish_reason or reason
        cities = [json.loads(a)["city"] for a in args.values()]
    else:
        r = client.chat.completions.create(messages=messages, **kw)
        reason = r.choices[0].finish_reason
        cities = [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls or []]
    assert reason == "tool_calls" and cities == ["Paris"]


def test_auto_reads_the_call_the_model_writes_as_fenced_json(client: openai.OpenAI) -> None:
    """Issue 35: asked plainly, the default model writes its call as a ```json block, which came back as text."""
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=TOOLS,
        max_tokens=100,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
