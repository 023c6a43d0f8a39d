"""The official anthropic SDK against a radixserve: `python anthropic_client.py URL SCENARIO` prints one JSON
document of what the SDK saw (run by tests/test_messages_sdk.py in an interpreter that has the SDK)."""

from __future__ import annotations

import json
import sys
from typing import Any

import anthropic

URL, SCENARIO = sys.argv[1], sys.argv[2]
KEY = sys.argv[3] if len(sys.argv) > 3 else "unused"
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "cache_control": {"type": "ephemeral", "ttl": "1h"},
}
SYSTEM = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
GREEDY = {"temperature": 0}
client = anthropic.Anthropic(base_url=URL, api_key=KEY, max_retries=0, timeout=60)


def create() -> Any:
    m = client.messages.create(
        model="default",
        system=SYSTEM,
        messages=[{"role": "user", "content": "Name a fast fox."}],
        max_tokens=6,
        stop_sequences=["\n\n\n"],
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0, "top_p": 0.9, "top_k": 20},  # this SDK no longer types them; the API takes them
    )
    return m.model_dump()


def stream() -> Any:
    with client.messages.stream(
        model="default", messages=[{"role": "user", "content": "Count."}], max_tokens=6, extra_body=GREEDY
    ) as s:
        events = [e.type for e in s if e.type != "text"]  # the SDK adds its own "text" events to the wire's
        final = s.get_final_message()
    return {"events": events, "final": final.model_dump()}


def _call(messages: list, streamed: bool) -> anthropic.types.Message:
    kw = dict(model="default", messages=messages, tools=[WEATHER], max_tokens=300, extra_body=GREEDY)
    kw["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}
    if not streamed:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


def tools(streamed: bool) -> Any:
    """A tool_use / tool_result round trip: the call, the result sent back, the answer."""
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = _call(messages, streamed)
    use = next(b for b in first.content if b.type == "tool_use")
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temp": 21})}
    messages.append({"role": "user", "content": [result]})
    final = client.messages.create(
        model="default", messages=messages, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8
    )
    return {"first": first.model_dump(), "final": final.model_dump()}


def agent_loop() -> Any:
    """An agent loop as Anthropic's docs write it: call, run the tools asked for, send results, until no tool_use."""
    messages: list = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    exchanges = []
    for turn in range(4):
        choice = {"type": "any"} if turn == 0 else {"type": "auto"}  # random weights: make the first turn a call
        m = client.messages.create(
            model="default", messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=300, extra_body=GREEDY
        )
        exchanges.append(m.model_dump())
        messages.append({"role": "assistant", "content": m.content})  # the SDK's blocks, sent back as they are
        if m.stop_reason != "tool_use":
            break
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"sunny in {b.input['city']}"}
            for b in m.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    return exchanges


def count() -> Any:
    messages = [{"role": "user", "content": "Name a fast fox."}]
    n = client.messages.count_tokens(model="default", system="You are terse.", messages=messages)
    return {"input_tokens": n.input_tokens}


def cache() -> Any:
    """Two turns of one conversation: the second reads the first's prompt from the cache."""
    messages: list = [{"role": "user", "content": "Tell me about foxes in one long sentence, please."}]
    first = client.messages.create(model="default", system=SYSTEM, messages=messages, max_tokens=8, extra_body=GREEDY)
    messages.append({"role": "assistant", "content": first.content[0].text if first.content else ""})
    messages.append({"role": "user", "content": "And wolves?"})
    second = client.messages.create(model="default", system=SYSTEM, messages=messages, max_tokens=8, extra_body=GREEDY)
    return {"first": first.usage.model_dump(), "second": second.usage.model_dump()}


def errors() -> Any:
    """Bad input: the SDK's own exception types, from Anthropic's error envelope."""
    out = []
    bad = [
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "extra_body": {"temperature": -1}},
    ]
    for kw in bad:
        try:
            client.messages.create(model="default", **kw)
            out.append(None)
        except anthropic.APIStatusError as exc:
            out.append({"class": type(exc).__name__, "status": exc.status_code, "body": exc.body})
    return out


SCENARIOS = {
    "create": create,
    "stream": stream,
    "tools": lambda: tools(False),
    "tools_stream": lambda: tools(True),
    "agent_loop": agent_loop,
    "count": count,
    "cache": cache,
    "errors": errors,
}
print(json.dumps(SCENARIOS[SCENARIO]()))
