"""Issue 35: tool-call formats by model family, picked from the chat template. A Llama 3.x-shaped or Mistral-shaped
template was a 400 ("this model's chat template has no tool-call format"); now each family's calls are held by a
grammar in its own form and parsed back, whole and streamed, on the tiny model with that family's template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.tool_calls import ToolStream, tool_format
from tool_templates import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, WEATHER

TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
# Each family's own spelling of two calls, as its models write them.
WRITTEN = {
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}\n'
    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}]',
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family_engine(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Engine]:
    model = tmp_path / request.param
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config_path.write_text(
        json.dumps(dict(json.loads(config_path.read_text()), chat_template=TEMPLATES[request.param]))
    )
    with engine_left_at_rest(model, dtype="float32", max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def test_the_family_is_picked_from_the_template_and_its_calls_parsed(family_engine: Engine) -> None:
    fmt = tool_format(family_engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None and fmt.family.name in TEMPLATES
    text = WRITTEN[fmt.family.name]
    content, calls = fmt.parse(text)
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    for size in (1, 4, len(text)):
        stream = ToolStream(fmt)
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i : i + size])] + stream.finish()
        assert [json.loads(e.call.arguments)["city"] for e in events if e.call] == ["Oslo", "Rome"]
        assert not "".join(e.content for e in events).strip()


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_round_trip_in_the_familys_format(family_engine: Engine, stream: bool) -> None:
    """Random weights: only the grammar (in the family's form) makes the output a call, which the parser reads."""
    with BackgroundServer(build_app(family_engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages: list = [{"role": "user", "content": "Weather in Oslo?"}]
        kw = dict(model="default", tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0)
        kw["parallel_tool_calls"] = False  # random weights would go on listing calls until max_tokens
        if stream:
            chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
            heads = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
            args = "".join(
                d.function.arguments or "" for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []
            )
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
            call = {"id": heads[0].id, "name": heads[0].function.name, "arguments": args} if len(heads) == 1 else {}
        else:
            r = client.chat.completions.create(messages=messages, **kw)
            reason, [tc] = r.choices[0].finish_reason, r.choices[0].message.tool_calls[:1]
            call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
        assert reason == "tool_calls" and call["name"] == "get_weather"
        assert set(json.loads(call["arguments"])) == {"city", "unit"}
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"type": "function", **_as_call(call)}]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
        final = client.chat.completions.create(
            model="default", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
        )
        assert final.choices[0].finish_reason in ("stop", "length")


def _as_call(call: dict) -> dict:
    return {"id": call["id"], "function": {"name": call["name"], "arguments": call["arguments"]}}
