"""Issue 35, item 4: with `tool_choice: required` and parallel calls allowed (every agent library's default), a small
model called tool after tool (Paris, London, Berlin, ... on the default model) until max_tokens. Now the grammar lets
it end after each complete call, a call that repeats an earlier one ends the list, `parallel_tool_calls: false`
means one call, and streamed and whole answers carry the same calls."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai
import pytest

from radixserve import Engine
from radixserve.constrained.grammar import GrammarMatcher, built
from radixserve.server.chat_job import structure
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tool_calls import ToolStream, tool_format
from server_fixtures import client, engine, server  # noqa: F401 - fixtures

PING = {  # no parameters: every call of it is the same call
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    },
}


def _call(city: str, spacing: str = " ") -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city":{spacing}"{city}"}}}}\n</tool_call>'


def _streamed(fmt: Any, text: str, size: int) -> list[str]:
    stream = ToolStream(fmt)
    events = [e for i in range(0, len(text), size) for e in stream.feed(text[i : i + size])] + stream.finish()
    return [json.loads(e.call.arguments)["city"] for e in events if e.call is not None]


def test_a_repeated_call_ends_the_list_whole_and_streamed(engine: Engine) -> None:
    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None
    # The repeat is written with other spacing: the same arguments by value are the same call.
    text = "\n".join([_call("Oslo"), _call("Rome"), _call("Oslo", spacing=""), _call("Paris")]) + "\nthen text"
    content, calls = fmt.parse(text)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"] and content is None
    for size in (1, 4, 9, len(text)):
        assert _streamed(fmt, text, size) == ["Oslo", "Rome"]


def test_parallel_tool_calls_false_keeps_exactly_one_call(engine: Engine) -> None:
    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}), parallel=False)
    assert fmt is not None
    text = "Checking.\n" + _call("Oslo") + "\n" + _call("Rome")
    content, calls = fmt.parse(text)
    assert content == "Checking." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo"]
    for size in (1, 5, len(text)):
        assert _streamed(fmt, text, size) == ["Oslo"]


def _accepting(engine: Engine, grammar: str, text: str) -> bool:
    m = GrammarMatcher(built(engine.grammars.compile("ebnf", grammar)), engine.model_info()["vocab_size"])
    return all(m.accept(t) for t in engine.tokenizer.encode(text)) and m.ll.is_accepting()


def test_required_lets_the_model_end_after_each_call(engine: Engine) -> None:
    """The newline between two calls left the call marker as the only continuation, which jump-forward then forced:
    a model that wrote the newline had to call again. Now the turn may end there too."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"}
    grammar = structure(msgspec.convert(body, ChatCompletionRequest), engine.tokenizer).grammar["ebnf"]
    assert _accepting(engine, grammar, _call("Oslo"))
    assert _accepting(engine, grammar, _call("Oslo") + "\n")  # (it was not: only "<tool_call>" could follow)
    assert _accepting(engine, grammar, _call("Oslo") + "\n" + _call("Rome") + "\n")
    single = structure(msgspec.convert({**body, "parallel_tool_calls": False}, ChatCompletionRequest), engine.tokenizer)
    assert not _accepting(engine, single.grammar["ebnf"], _call("Oslo") + "\n" + _call("Rome"))


def _never_ending(engine: Engine, ask: str, tool: dict, **extra: Any) -> dict[str, Any]:
    """A greedy tool_choice required request whose model may not end the turn (end of sequence biased away)."""
    bias = {str(t): -100 for t in engine.tokenizer.eos_token_ids}
    messages = [{"role": "user", "content": ask}]
    return dict(
        model="default",
        messages=messages,
        tools=[tool],
        tool_choice="required",
        temperature=0,
        logit_bias=bias,
        **extra,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_that_repeats_its_call_is_stopped_there(client: openai.OpenAI, engine: Engine, stream: bool) -> None:
    """A bias against end of sequence keeps the model from ending, so the grammar makes it call `ping` again and
    again, the same call each time: the turn ends at the first repeat with that one call (it ran to max_tokens with
    dozens of them)."""
    kw = _never_ending(engine, "Ping.", PING, max_tokens=400)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        used = chunks[-1].usage
    else:
        r = client.chat.completions.create(**kw)
        calls, reasons, content, used = r.choices[0].message.tool_calls or [], [r.choices[0].finish_reason], "", r.usage
        content = r.choices[0].message.content or ""
    assert [c.function.name for c in calls] == ["ping"] and reasons == ["tool_calls"] and content == ""
    assert used is not None and used.completion_tokens < 250  # two calls (~100 tiny tokens), not max_tokens (400)


def test_an_echo_of_the_call_just_answered_is_no_new_call(engine: Engine) -> None:
    """The default model, given a call's result, writes the call again and then the result: read as a new call, it
    sent agents round the same call forever. An echo of a call whose result the request sends back is dropped."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 21}'},
        ],
        "tools": [WEATHER],
    }
    fmt = structure(msgspec.convert(body, ChatCompletionRequest), engine.tokenizer).parser
    assert fmt is not None
    text = '{"name": "get_weather", "arguments": {"city":"Paris"}}\n{"temperature_c": 21}'
    assert fmt.parse(text) == ('{"temperature_c": 21}', [])
    stream = ToolStream(fmt)
    events = [e for i in range(0, len(text), 3) for e in stream.feed(text[i : i + 3])] + stream.finish()
    assert "".join(e.content for e in events) == '{"temperature_c": 21}' and not any(e.call for e in events)
    assert [c.name for c in fmt.parse(_call("Rome"))[1]] == ["get_weather"]  # another call is a call
    new_turn = {**body, "messages": [*body["messages"], {"role": "user", "content": "And again?"}]}
    fresh = structure(msgspec.convert(new_turn, ChatCompletionRequest), engine.tokenizer).parser
    assert fresh is not None and fresh.parse(text)[1]  # after a new user message it may call again


def test_streamed_and_whole_answers_carry_the_same_calls(client: openai.OpenAI, engine: Engine) -> None:
    """Both read the engine's stream and stop at the same place, each of n samples alone."""
    kw = _never_ending(engine, "Weather?", WEATHER, max_tokens=300, n=2)  # calls until one repeats or it ends
    whole = client.chat.completions.create(**kw)
    streamed: dict[int, dict[int, list[str]]] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                parts = streamed.setdefault(choice.index, {}).setdefault(d.index, ["", ""])
                parts[0] += d.function.name or ""
                parts[1] += d.function.arguments or ""
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index, "")
    for choice in whole.choices:
        calls = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
        assert calls and calls == list(streamed[choice.index].values())
        assert choice.finish_reason == reasons[choice.index]
