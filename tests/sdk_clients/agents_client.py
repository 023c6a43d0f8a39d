"""The openai-agents SDK with its default (Responses) model against a radixserve: `python agents_client.py URL MODE`
(MODE run or streamed) runs an agent with one function tool and prints what it did as JSON (run by
tests/test_responses_api.py in an interpreter that has the SDK)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

URL, MODE = sys.argv[1], sys.argv[2]
calls: list[dict] = []


class Answer(BaseModel):
    sunny: bool


@function_tool
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """Weather in a city."""
    calls.append({"city": city})
    return f"sunny in {city}"


async def main() -> dict:
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0), use_for_tracing=False)
    agent = Agent(
        name="weather",
        model="default",  # a name: the SDK's default provider serves it with its Responses model
        instructions="Use the tool.",
        tools=[get_weather],
        output_type=Answer,  # random weights: a schema (text.format) makes the answer end before max_tokens
        # random weights: "required" makes the first turn a call; the SDK resets it to auto after the call
        model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
    )
    if MODE == "streamed":
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        kinds = [e.type async for e in result.stream_events()]
    else:
        result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
        kinds = []
    return {
        "calls": calls,
        "items": [item.type for item in result.new_items],
        "responses": [
            {"id": r.response_id, "usage": r.usage.input_tokens, "output": [o.type for o in r.output]}
            for r in result.raw_responses
        ],
        "final_output": result.final_output.model_dump(),
        "stream_events": sorted(set(kinds)),
    }


print(json.dumps(asyncio.run(main())))
