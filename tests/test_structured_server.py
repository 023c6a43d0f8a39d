"""Structured output over HTTP on the tiny model (random weights: only the grammar makes its output parse):
/generate with regex / json_schema / ebnf, the openai SDK's `chat.completions.parse(response_format=Model)`, and a
tool-call round trip (call, tool result, answer), streamed and not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from pydantic import BaseModel, Field

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.constrained.grammar import GrammarMatcher, built
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(tiny_model_dir, dtype="float32", max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_generate_takes_regex_json_schema_and_ebnf(server: BackgroundServer) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    cases = [
        ({"regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"json_schema": json.dumps(schema)}, lambda t: 1 <= json.loads(t)["n"] <= 9),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]
    for extra, ok in cases:
        for temperature in (0.0, 1.0):
            r = httpx.post(
                server.url + "/generate",
                json={
                    "text": "Answer:",
                    "sampling_params": {"max_new_tokens": 40, "temperature": temperature, "seed": 3, **extra},
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert ok(out["text"]), (extra, out["text"])


@pytest.mark.parametrize(
    "field,value",
    [("regex", "[a-"), ("json_schema", {"type": "objectx"}), ("json_schema", "{not json"), ("ebnf", "root ::= (")],
)
def test_bad_grammar_is_a_400_naming_the_field(server: BackgroundServer, field: str, value: object) -> None:
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {field: value}}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_grammar_that_cannot_end_in_time_finishes_with_length(server: BackgroundServer) -> None:
    r = httpx.post(
        server.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "regex": "a{20}"}},
        timeout=60,
    )
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["text"] == "a" * len(out["text"])


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        r = client.chat.completions.parse(
            model="default",
            messages=[{"role": "user", "content": "A person?"}],
            response_format=Person,
            max_tokens=120,
            temperature=temperature,
            seed=1,
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "JSON?"}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    text = r.choices[0].message.content  # any object: random weights may ramble in a string until max_tokens
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def _round_trip(client: openai.OpenAI, stream: bool, tool_choice: object) -> None:
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(
        model="default", tools=TOOLS, tool_choice=tool_choice, max_tokens=300, temperature=0, parallel_tool_calls=False
    )
    if stream:
        calls: dict[int, dict] = {}
        reason = None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            choice = chunk.choices[0]
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or d.id
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
        assert reason == "tool_calls" and calls, calls
        call = calls[0]
    else:
        r = client.chat.completions.create(messages=messages, **kw)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        tc = r.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["name"] == "get_weather" and call["id"]
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp": 21})})
    final = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client: openai.OpenAI, stream: bool, tool_choice: object) -> None:
    _round_trip(client, stream, tool_choice)


NESTED_TOOL = {  # what the openai SDK's pydantic_function_tool sends for a model with a nested model: $defs + $ref
    "type": "function",
    "function": {
        "name": "add_people",
        "parameters": {
            "$defs": {
                "Person": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "maxItems": 2}},
            "required": ["people"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add_people"}}])
def test_a_tool_whose_parameters_use_defs_and_refs_is_called(client: openai.OpenAI, tool_choice: object) -> None:
    """Issue 35: the call's grammar nests the parameters under a wrapper; their "#/$defs/..." refs must still resolve
    (it was a 400, "Pointer '/$defs/Person' does not exist")."""
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Add Ann, 31."}],
        tools=[*TOOLS, NESTED_TOOL],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls or []
    if r.choices[0].finish_reason == "tool_calls":
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "add_people":  # shaped by the referenced schema
                assert all(set(p) == {"name", "age"} and isinstance(p["age"], int) for p in args["people"])
    else:  # a random tiny model may run out of tokens inside a call: then it ends by length, never a 400
        assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [4, 16])  # the tiny tokenizer spells the marker in pieces: cut inside, after
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_never_reaches_content(
    client: openai.OpenAI, stream: bool, max_tokens: int
) -> None:
    """Issue 35: the grammar starts a call, max_tokens ends it part way: no "<tool_call>" markup in content (it
    leaked whole, and in a stream as the delta '<tool_call>\n{"name":'), finish_reason length."""
    kw = dict(model="default", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=max_tokens)
    if stream:
        chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        r = client.chat.completions.create(tool_choice="required", **kw)
        content, calls, reason = r.choices[0].message.content or "", r.choices[0].message.tool_calls or [], None
        reason = r.choices[0].finish_reason
    assert content == "" and not calls  # (it was '<too', '<tool_call>\n{"nam')
    assert reason == "length"


def test_truncated_calls_are_dropped_by_the_parser(engine: Engine) -> None:
    from radixserve.server.tool_calls import ToolStream, tool_format

    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    text = "Sure. " + whole + '<tool_call>\n{"name": "get_wea'
    content, calls = fmt.parse(text, truncated=True)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]
    assert fmt.parse("no calls <tool_call> here") == ("no calls <tool_call> here", [])  # not cut off: text
    stream = ToolStream(fmt)
    events = stream.feed(text) + stream.finish(truncated=True)
    assert "".join(e.content for e in events) == "Sure. " and sum(e.call is not None for e in events) == 1


def test_response_format_with_tools_in_auto_leaves_a_call_open(engine: Engine) -> None:
    """Issue 35: with tools, tool_choice auto and response_format, the whole turn was held to the schema, so no
    call could ever start (openai-agents' Agent(output_type=..., tools=...) never called). Now the grammar takes a
    call or an answer in the schema, and nothing else."""
    from radixserve.server.chat_job import structure
    from radixserve.server.protocol import ChatCompletionRequest

    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "x"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
        },
    }
    req = msgspec.convert(body, ChatCompletionRequest)
    grammar = structure(req, engine.tokenizer).grammar["ebnf"]
    compiled = built(engine.grammars.compile("ebnf", grammar))
    vocab = engine.model_info()["vocab_size"]

    def accepts(text: str) -> bool:
        m = GrammarMatcher(compiled, vocab)
        return all(m.accept(t) for t in engine.tokenizer.encode(text)) and m.ll.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert accepts(call)
    assert accepts('{"ok": true}')
    assert not accepts("free text")


def test_rebase_refs_points_local_refs_at_the_embedded_schema() -> None:
    from radixserve.server.tool_grammar import rebase_refs

    schema = {"$defs": {"N": {"properties": {"next": {"$ref": "#"}}}}, "items": {"$ref": "#/$defs/N"}}
    out = rebase_refs(schema, "#/anyOf/1/properties/arguments")
    assert out["items"]["$ref"] == "#/anyOf/1/properties/arguments/$defs/N"
    assert out["$defs"]["N"]["properties"]["next"]["$ref"] == "#/anyOf/1/properties/arguments"
    assert rebase_refs({"$ref": "https://example.com/s.json"}, "#/x") == {"$ref": "https://example.com/s.json"}


def test_unknown_named_tool_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert err.value.body["param"] == "tool_choice"


def test_tool_call_parser_whole_and_streamed_in_any_pieces(engine: Engine) -> None:
    from radixserve.server.tool_calls import ToolStream, tool_format

    fmt = tool_format(engine.tokenizer, frozenset({"get_weather"}))
    assert fmt is not None
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}\n'
        "</tool_call>"
    )
    content, calls = fmt.parse(text)
    assert content == "Let me check." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert fmt.parse("no calls <tool_call> here") == ("no calls <tool_call> here", [])
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(fmt)
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i : i + size])] + stream.finish()
        assert "".join(e.content for e in events) == "Let me check.\n"
        assert [(e.index, e.call.name) for e in events if e.call] == [(0, "get_weather"), (1, "get_weather")]
    # A bare call (no markers) of a known tool counts, whole or streamed; other JSON stays content.
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert [c.name for c in fmt.parse(bare)[1]] == ["get_weather"]
    assert fmt.parse('{"name": "other", "arguments": {}}')[1] == []
    stream = ToolStream(fmt)
    events = [e for i in range(0, len(bare), 5) for e in stream.feed(bare[i : i + 5])] + stream.finish()
    assert [e.call.name for e in events if e.call] == ["get_weather"] and not any(e.content for e in events)


class Contact(BaseModel):
    name: str = Field(max_length=8)


def test_a_parsed_message_goes_back_as_the_sdk_appends_it(client: openai.OpenAI) -> None:
    """The openai SDK's docs append `parse`'s message to the history as it is: its `parsed` and the calls'
    `parsed_arguments` travel with it (the agent suite's pydantic tool scenario got a 400 naming them)."""
    messages: list = [{"role": "user", "content": "Save Ann."}]
    first = client.chat.completions.parse(
        model="default",
        messages=messages,
        tools=[openai.pydantic_function_tool(Contact)],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, so random weights end after it
        max_tokens=200,
        temperature=0,
    )
    message = first.choices[0].message
    assert message.tool_calls and isinstance(message.tool_calls[0].function.parsed_arguments, Contact), message
    messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "saved"}]
    final = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
