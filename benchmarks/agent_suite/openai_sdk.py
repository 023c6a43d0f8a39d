"""The openai SDK as an agent loop is written with it: Chat Completions with tools (auto, required, named,
streamed, parallel allowed, a pydantic tool), structured outputs (`parse`, `json_object`), a multi-turn chat whose
later turns hit the prompt cache, and the Responses API's function calls."""

from __future__ import annotations

import json

from openai import OpenAI, pydantic_function_tool
from pydantic import BaseModel

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import (
    ADD_TOOL,
    LONG_SYSTEM,
    MAX_ROUNDS,
    MAX_TOKENS,
    MODEL,
    SYSTEM,
    WEATHER_TOOL,
    ToolLog,
    answered,
    scenario,
)

LIB = "openai"


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


def _run_calls(log: ToolLog, calls: list) -> list[dict]:
    """Run each call's tool; the `tool` messages that send the results back."""
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        result = getattr(log, c.function.name)(**args)
        out.append({"role": "tool", "tool_call_id": c.id, "content": str(result)})
    return out


def _round_trip(url: str, question: str, tools: list, tool_choice: object, **extra: object) -> ToolLog:
    """Ask; the model must call; send the results back with tool_choice auto; an answer must come."""
    client, log = _client(url), ToolLog()
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=MAX_TOKENS,
        **extra,
    )
    msg = first.choices[0].message
    expect(msg.tool_calls, f"no tool call (finish {first.choices[0].finish_reason}, text {msg.content!r:.80})")
    expect(first.choices[0].finish_reason == "tool_calls", f"finish_reason {first.choices[0].finish_reason}")
    # the loop of the SDK's function-calling guide: run the calls, send the results, until an answer comes
    for _ in range(MAX_ROUNDS):
        messages += [msg.model_dump(exclude_none=True), *_run_calls(log, msg.tool_calls or [])]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=MAX_TOKENS
        )
        msg = reply.choices[0].message
        if not msg.tool_calls:
            break
    expect(not msg.tool_calls, f"still calling after {MAX_ROUNDS} rounds")
    answered(msg.content)
    return log


@scenario(LIB)
def tool_round_trip_auto(url: str) -> None:
    log = _round_trip(url, "What is the weather in Paris?", [WEATHER_TOOL], "auto")
    expect(log.called("get_weather"), "get_weather not called")


@scenario(LIB)
def tool_choice_required(url: str) -> None:
    log = _round_trip(url, "Is it warm in Madrid today?", [WEATHER_TOOL, ADD_TOOL], "required")
    expect(log.calls, "no tool ran")


@scenario(LIB)
def tool_choice_named(url: str) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    log = _round_trip(url, "What is 17 plus 25?", [WEATHER_TOOL, ADD_TOOL], named)
    expect(log.called("add"), "add not called")


@scenario(LIB)
def parallel_calls_allowed(url: str) -> None:
    log = _round_trip(
        url, "What is the weather in Paris and in Tokyo?", [WEATHER_TOOL], "auto", parallel_tool_calls=True
    )
    expect(log.called("get_weather"), "get_weather not called")


@scenario(LIB)
def streamed_tool_call(url: str) -> None:
    """Stream the first turn, gathering each call from its `delta.tool_calls` pieces as the SDK's docs show."""
    client, log = _client(url), ToolLog()
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Berlin?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function and d.function.name) or ""
            c["arguments"] += (d.function and d.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    expect(calls, f"no streamed tool call (finish {finish})")
    expect(finish == "tool_calls", f"finish_reason {finish}")
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()
    ]
    messages.append({"role": "assistant", "tool_calls": tool_calls})
    for c in calls.values():
        result = getattr(log, c["name"])(**json.loads(c["arguments"]))
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    text = ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=MAX_TOKENS, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    answered(text)


class Address(BaseModel):
    city: str
    country: str


class CreateContact(BaseModel):
    """Save a contact to the address book."""

    name: str
    address: Address


@scenario(LIB)
def pydantic_function_tool_nested(url: str) -> None:
    """A strict tool from a pydantic model whose schema nests another through $defs; `parse` validates the call."""
    client = _client(url)
    tool = pydantic_function_tool(CreateContact)
    messages: list = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Save Marie Curie, who lives in Paris, France."},
    ]
    first = client.chat.completions.parse(
        model=MODEL, messages=messages, tools=[tool], tool_choice="required", temperature=0, max_tokens=MAX_TOKENS
    )
    calls = first.choices[0].message.tool_calls or []
    expect(calls, "no tool call")
    contact = calls[0].function.parsed_arguments
    expect(isinstance(contact, CreateContact) and contact.name, f"arguments not a CreateContact: {contact!r}")
    # the parsed message goes back as it is, as the SDK's docs append it (its `parsed` fields travel with it)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": calls[0].id, "content": "saved"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    answered(final.choices[0].message.content)


class Event(BaseModel):
    name: str
    year: int


@scenario(LIB)
def structured_output_parse(url: str) -> None:
    out = _client(url).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "The first Moon landing, Apollo 11, was in 1969. Extract the event."}],
        response_format=Event,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    event = out.choices[0].message.parsed
    expect(isinstance(event, Event), f"not parsed: {out.choices[0].message.content!r:.100}")
    expect(event.year == 1969, f"year {event.year}")


@scenario(LIB)
def json_object_mode(url: str) -> None:
    out = _client(url).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Reply in JSON with keys city and country."},
            {"role": "user", "content": "Where is the Eiffel Tower?"},
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    doc = json.loads(out.choices[0].message.content or "")
    expect(isinstance(doc, dict) and doc, f"not a JSON object: {doc!r:.100}")


@scenario(LIB)
def multi_turn_cached(url: str) -> None:
    """Three turns with a tool on a long fixed system prompt: later turns resend the history, which the server
    should find in its prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    client, log = _client(url), ToolLog()
    messages: list = [{"role": "system", "content": LONG_SYSTEM}]
    cached = []
    for question in ("What is the weather in Rome?", "And in Oslo?", "Which of the two did you check first?"):
        messages.append({"role": "user", "content": question})
        for _ in range(3):  # a call, its result, the answer
            r = client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=MAX_TOKENS
            )
            details = r.usage and r.usage.prompt_tokens_details
            cached.append((details and details.cached_tokens) or 0)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            messages += _run_calls(log, msg.tool_calls)
        expect(not msg.tool_calls, f"still calling after 3 requests on {question!r}")
        answered(msg.content)
    expect(log.called("get_weather"), "get_weather never called")
    expect(max(cached[1:], default=0) > 0, f"no cached tokens reported on later turns: {cached}")


@scenario(LIB)
def responses_function_call(url: str) -> None:
    """The Responses API's loop: a function_call item, its function_call_output back, a message."""
    client, log = _client(url), ToolLog()
    tools = [{"type": "function", **{k: WEATHER_TOOL["function"][k] for k in ("name", "description", "parameters")}}]
    items: list = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    first = client.responses.create(
        model=MODEL, input=items, tools=tools, instructions=SYSTEM, temperature=0, max_output_tokens=MAX_TOKENS
    )
    calls = [o for o in first.output if o.type == "function_call"]
    expect(calls, f"no function_call (output {[o.type for o in first.output]})")
    items += first.output
    for c in calls:
        result = getattr(log, c.name)(**json.loads(c.arguments))
        items.append({"type": "function_call_output", "call_id": c.call_id, "output": result})
    final = client.responses.create(
        model=MODEL, input=items, tools=tools, instructions=SYSTEM, temperature=0, max_output_tokens=MAX_TOKENS
    )
    answered(final.output_text)
