"""Issue 35, item 5: in `tool_choice: auto` a small model often writes its call as a ```json fence or as bare
objects, one after another; they were returned as text. They are calls now when, and only when, they name a declared
tool, whole or streamed alike. And a lazy grammar leaves the text free but holds each call that starts (by the
model's marker, or an object opening `{"name": "`) to a declared tool and its parameter schema."""

from __future__ import annotations

import json

import msgspec
import pytest

from radixserve import Engine
from radixserve.constrained.grammar import GrammarMatcher, built
from radixserve.server.chat_job import structure
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tool_calls import ToolStream, tool_format
from server_fixtures import engine  # noqa: F401 - fixture
from tool_templates import WEATHER

OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
FORMS = [  # (text, content, cities called)
    (
        '```json\n{\n    "name": "get_weather",\n    "arguments": {\n        "city": "Paris"\n    }\n}\n```',
        None,
        ["Paris"],
    ),
    ("Sure.\n" + OSLO + "\n" + OSLO.replace("Oslo", "Rome"), "Sure.", ["Oslo", "Rome"]),
    ("```\n" + OSLO + "\n```\nDone.", "Done.", ["Oslo"]),
    ('He wrote "{" and ' + OSLO.replace("Oslo", 'a}b\\"c'), 'He wrote "{" and', ['a}b"c']),
]
NOT_CALLS = [
    '{"name": "other_tool", "arguments": {}}',  # names no declared tool
    "Use {x} and ```python\nprint({1: 2})\n``` ok",  # braces and fences in ordinary text
    '```json\n{"city": "Oslo"}\n```',  # JSON, but no call
]


def _streamed(fmt: object, text: str, size: int) -> tuple[str, list[str]]:
    stream = ToolStream(fmt)  # type: ignore[arg-type]
    events = [e for i in range(0, len(text), size) for e in stream.feed(text[i : i + size])] + stream.finish()
    cities = [json.loads(e.call.arguments)["city"] for e in events if e.call is not None]
    return "".join(e.content for e in events), cities


@pytest.mark.parametrize(("text", "content", "cities"), FORMS)
def test_json_calls_outside_the_markers_are_calls(engine: Engine, text: str, content: str, cities: list) -> None:
    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None
    got_content, calls = fmt.parse(text)
    assert got_content == content and [json.loads(c.arguments)["city"] for c in calls] == cities
    for size in (1, 2, 5, len(text)):
        streamed_content, streamed_cities = _streamed(fmt, text, size)
        assert (streamed_content.strip() or None) == content and streamed_cities == cities


@pytest.mark.parametrize("text", NOT_CALLS)
def test_json_that_names_no_declared_tool_stays_text(engine: Engine, text: str) -> None:
    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None
    assert fmt.parse(text) == (text, [])
    for size in (1, 3, len(text)):
        assert _streamed(fmt, text, size) == (text, [])


def _auto_grammar(engine: Engine, parallel: bool = True) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "auto"}
    req = msgspec.convert({**body, "parallel_tool_calls": parallel}, ChatCompletionRequest)
    shape = structure(req, engine.tokenizer)
    assert "ebnf" in shape.grammar  # (auto had no grammar: a call that started could be anything)
    return shape.grammar["ebnf"]


def _accepts(engine: Engine, grammar: str, text: str) -> bool:
    m = GrammarMatcher(built(engine.grammars.compile("ebnf", grammar)), engine.model_info()["vocab_size"])
    return all(m.accept(t) for t in engine.tokenizer.encode(text)) and m.ll.is_accepting()


def test_auto_holds_a_started_call_to_a_declared_tool(engine: Engine) -> None:
    grammar = _auto_grammar(engine)
    assert _accepts(engine, grammar, "Any text at all, {braces} and ```fences```.")
    assert _accepts(engine, grammar, "Let me look.\n<tool_call>\n" + OSLO + "\n</tool_call>")
    assert _accepts(engine, grammar, "```json\n" + OSLO + "\n```\nand " + OSLO.replace("Oslo", "Rome"))
    assert not _accepts(engine, grammar, '{"name": "nope", "arguments": {}}')  # no such tool
    assert not _accepts(engine, grammar, OSLO.replace('"Oslo"', "5"))  # not its parameters
    assert not _accepts(engine, grammar, "<tool_call>\n" + OSLO.replace("city", "town") + "\n</tool_call>")


def test_a_call_takes_no_argument_its_tool_does_not_declare(engine: Engine) -> None:
    """The agent suite: with a tool whose schema leaves additionalProperties unsaid (as most libraries send it), the
    default model wrote `{"city": "Paris", "required": ["city"]}`, copying the schema's keys into its arguments.
    Objects that declare their properties now take no others, in auto (lazy) and required grammars alike."""
    open_tool = {
        "type": "function",
        "function": {**WEATHER["function"], "parameters": dict(WEATHER["function"]["parameters"])},
    }
    del open_tool["function"]["parameters"]["additionalProperties"]
    extra = OSLO.replace('"c"}', '"c", "required": ["city"]}')
    for choice in ("auto", "required"):
        grammar = _grammar_for(engine, open_tool, choice)
        assert _accepts(engine, grammar, "<tool_call>\n" + OSLO + "\n</tool_call>"), choice
        assert not _accepts(engine, grammar, "<tool_call>\n" + extra + "\n</tool_call>"), choice
    assert not _accepts(engine, _grammar_for(engine, open_tool, "auto"), extra)  # a bare call, too


def _grammar_for(engine: Engine, tool: dict, choice: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": choice}
    return structure(msgspec.convert(body, ChatCompletionRequest), engine.tokenizer).grammar["ebnf"]


def test_closing_objects_leaves_data_and_allof_alone() -> None:
    from radixserve.server.tool_grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {}}}, "x": {"default": {"properties": {}}}},
        "$defs": {"P": {"type": "object", "properties": {"n": {}}}},
        "anyOf": [{"allOf": [{"properties": {"a": {}}}], "properties": {"b": {}}}],
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert out["properties"]["x"] == {"default": {"properties": {}}}  # a default is data
    assert out["$defs"]["P"]["additionalProperties"] is False
    assert out["anyOf"][0] == schema["anyOf"][0]  # an allOf's branches and its object stay open
    assert "additionalProperties" not in schema  # the request's own schema is not changed
