"""openai-agents (the OpenAI Agents SDK) as its docs show it against another provider: an AsyncOpenAI client on
our base URL, function tools, the Chat Completions model and the default Responses one, a structured `output_type`
alone and beside tools, a streamed run, `tool_choice="required"` and a second turn from `to_input_list()`."""

from __future__ import annotations

import asyncio
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import MAX_TOKENS, MODEL, SYSTEM, ToolLog, answered, scenario

LIB = "openai-agents"
SETTINGS = ModelSettings(temperature=0, max_tokens=MAX_TOKENS)


def _agent(url: str, log: ToolLog, responses: bool = False, **kw: Any) -> Agent:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model_cls = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    model = model_cls(model=MODEL, openai_client=client)

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return log.get_weather(city)

    kw.setdefault("model_settings", SETTINGS)
    return Agent(name="assistant", instructions=SYSTEM, model=model, tools=[get_weather], **kw)


def _items(result: Any) -> list[str]:
    return [item.type for item in result.new_items]


def _round_trip(result: Any, log: ToolLog) -> None:
    """The SDK ran the tool, sent its result back and ended with a final answer."""
    kinds = _items(result)
    expect(log.called("get_weather"), f"get_weather not called (items {kinds})")
    expect("tool_call_output_item" in kinds, f"no tool result went back (items {kinds})")
    expect(kinds[-1] == "message_output_item", f"the run did not end on a message (items {kinds})")


@scenario(LIB)
def chat_model_tool_round_trip(url: str) -> None:
    log = ToolLog()
    result = asyncio.run(Runner.run(_agent(url, log), "What is the weather in Paris?", max_turns=4))
    _round_trip(result, log)
    answered(result.final_output)


@scenario(LIB)
def responses_model_tool_round_trip(url: str) -> None:
    log = ToolLog()
    result = asyncio.run(Runner.run(_agent(url, log, responses=True), "What is the weather in Vienna?", max_turns=4))
    _round_trip(result, log)
    answered(result.final_output)


@scenario(LIB)
def tool_choice_required(url: str) -> None:
    """`required` on the first turn; the SDK resets it to auto after a call (reset_tool_choice), so it can end."""
    log = ToolLog()
    settings = ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice="required")
    result = asyncio.run(Runner.run(_agent(url, log, model_settings=settings), "Is Cairo hot?", max_turns=4))
    _round_trip(result, log)
    answered(result.final_output)


class Forecast(BaseModel):
    city: str
    sunny: bool


@scenario(LIB)
def tools_with_output_type(url: str) -> None:
    """Tools beside a structured `output_type`: the call comes first, the typed answer after it."""
    log = ToolLog()
    agent = _agent(url, log, output_type=Forecast)
    result = asyncio.run(Runner.run(agent, "Is it sunny in Madrid? Check the weather.", max_turns=4))
    _round_trip(result, log)
    expect(isinstance(result.final_output, Forecast), f"final output {result.final_output!r}")


class Capital(BaseModel):
    country: str
    capital: str


@scenario(LIB)
def output_type_only(url: str) -> None:
    agent = _agent(url, ToolLog(), output_type=Capital).clone(tools=[])
    result = asyncio.run(Runner.run(agent, "What is the capital of Italy?", max_turns=2))
    expect(isinstance(result.final_output, Capital), f"final output {result.final_output!r}")
    expect("rome" in result.final_output.capital.lower(), f"capital {result.final_output.capital!r}")


@scenario(LIB)
def streamed_run(url: str) -> None:
    log = ToolLog()

    async def go() -> tuple[Any, set[str]]:
        result = Runner.run_streamed(_agent(url, log), "What is the weather in Athens?", max_turns=4)
        events = {e.type async for e in result.stream_events()}
        return result, events

    result, events = asyncio.run(go())
    expect("raw_response_event" in events, f"no raw stream events ({sorted(events)})")
    _round_trip(result, log)
    answered(result.final_output)


@scenario(LIB)
def second_turn_from_history(url: str) -> None:
    """A follow-up built from the first run's `to_input_list()`, as the SDK's multi-turn docs show."""
    log = ToolLog()
    agent = _agent(url, log)

    async def go() -> tuple[Any, Any]:  # one event loop for both runs: the agent's client belongs to it
        first = await Runner.run(agent, "What is the weather in Dublin?", max_turns=4)
        follow = first.to_input_list() + [{"role": "user", "content": "And what is the weather in Prague?"}]
        return first, await Runner.run(agent, follow, max_turns=4)

    first, second = asyncio.run(go())
    _round_trip(first, log)
    expect(len(log.called("get_weather")) >= 2, f"second turn made no call (calls {log.calls})")
    answered(second.final_output)
