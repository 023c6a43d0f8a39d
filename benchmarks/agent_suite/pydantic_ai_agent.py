"""pydantic-ai's Agent on an OpenAI-compatible provider, as its docs show ("OpenAI-compatible models"): a tool round
trip, a typed `output_type` (returned through an output tool), one whose schema nests models, NativeOutput
(response_format), a streamed run with a tool, and a second run on the first's message history."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import MAX_TOKENS, MODEL, SYSTEM, ToolLog, answered, scenario

LIB = "pydantic-ai"
SETTINGS = {"temperature": 0, "max_tokens": MAX_TOKENS}


def _agent(url: str, log: ToolLog | None, output_type: Any = str) -> Agent:
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url, api_key="unused"))
    agent = Agent(model, instructions=SYSTEM, output_type=output_type, model_settings=SETTINGS, retries=1)
    if log is not None:

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            return log.get_weather(city)

    return agent


def _kinds(result: Any) -> list[str]:
    return [p.part_kind for m in result.all_messages() for p in m.parts]


def _round_trip(result: Any, log: ToolLog) -> None:
    kinds = _kinds(result)
    expect(log.called("get_weather"), f"get_weather not called (parts {kinds})")
    expect("tool-return" in kinds, f"no tool result went back (parts {kinds})")


@scenario(LIB)
def tool_round_trip(url: str) -> None:
    log = ToolLog()
    result = _agent(url, log).run_sync("What is the weather in Paris?")
    _round_trip(result, log)
    answered(result.output)


class CityInfo(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    born: int


class Invention(BaseModel):
    name: str
    inventor: Person


@scenario(LIB)
def output_type_nested(url: str) -> None:
    """The default output mode (the answer comes as a call to the `final_result` output tool) with a schema that
    nests a model ($defs/$ref in the output tool's parameters)."""
    out = _agent(url, None, Invention).run_sync("The telephone was invented by Alexander Graham Bell, born 1847.")
    expect(isinstance(out.output, Invention) and out.output.inventor.born == 1847, f"output {out.output!r}")


@scenario(LIB)
def native_output(url: str) -> None:
    out = _agent(url, None, NativeOutput(CityInfo)).run_sync("Where is Big Ben? Give the city and country.").output
    expect(isinstance(out, CityInfo) and "london" in out.city.lower(), f"output {out!r}")


@scenario(LIB)
def tools_with_output_type(url: str) -> None:
    """A tool and a typed output in one run: the call, its result, then the output tool."""
    log = ToolLog()
    result = _agent(url, log, CityInfo).run_sync("Check the weather in Kyoto, then give its city and country.")
    _round_trip(result, log)
    expect(isinstance(result.output, CityInfo), f"output {result.output!r}")


@scenario(LIB)
def streamed_run(url: str) -> None:
    log = ToolLog()

    async def go() -> tuple[str, Any]:
        async with _agent(url, log).run_stream("What is the weather in Rio de Janeiro?") as run:
            text = "".join([piece async for piece in run.stream_text(delta=True)])
        return text, run

    text, run = asyncio.run(go())
    _round_trip(run, log)
    answered(text)


@scenario(LIB)
def message_history(url: str) -> None:
    """A second run continues the first through `message_history`, as pydantic-ai's conversation docs show."""
    log = ToolLog()
    agent = _agent(url, log)
    first = agent.run_sync("What is the weather in Helsinki?")
    _round_trip(first, log)
    second = agent.run_sync("And in Stockholm?", message_history=first.all_messages())
    expect(len(log.called("get_weather")) >= 2, f"the second run made no call (calls {log.calls})")
    answered(second.output)
