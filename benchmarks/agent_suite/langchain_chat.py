"""langchain-openai's ChatOpenAI on our base URL, as LangChain's tool-calling docs use it: `bind_tools` with
tool_choice auto, any and a named tool, a streamed call gathered from chunks, `with_structured_output` by JSON
schema and by function calling, and a multi-turn chat whose later turns report cache reads."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import (
    LONG_SYSTEM,
    MAX_ROUNDS,
    MAX_TOKENS,
    MODEL,
    SYSTEM,
    ToolLog,
    answered,
    scenario,
)

LIB = "langchain-openai"


def _llm(url: str, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS, max_retries=0, **kw
    )


def _tools(log: ToolLog) -> list:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return log.get_weather(city)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return log.add(a, b)

    return [get_weather, add]


def _run_tools(tools: list, ai: AIMessage) -> list[ToolMessage]:
    by_name = {t.name: t for t in tools}
    return [by_name[c["name"]].invoke(c) for c in ai.tool_calls]  # invoking with the call gives a ToolMessage


def _round_trip(url: str, question: str, tool_choice: str | None) -> ToolLog:
    log = ToolLog()
    tools = _tools(log)
    llm = _llm(url)
    first_llm = llm.bind_tools(tools, tool_choice=tool_choice) if tool_choice else llm.bind_tools(tools)
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    ai = first_llm.invoke(messages)
    expect(ai.tool_calls, f"no tool call (text {ai.content!r:.80}, invalid {ai.invalid_tool_calls})")
    for _ in range(MAX_ROUNDS):  # LangChain's tool-calling loop: results back until the model answers
        messages += [ai, *_run_tools(tools, ai)]
        ai = llm.bind_tools(tools).invoke(messages)
        if not ai.tool_calls:
            break
    expect(not ai.tool_calls, f"still calling after {MAX_ROUNDS} rounds")
    answered(ai.content)
    return log


@scenario(LIB)
def bind_tools_auto(url: str) -> None:
    expect(_round_trip(url, "What is the weather in Paris?", None).called("get_weather"), "get_weather not called")


@scenario(LIB)
def bind_tools_any(url: str) -> None:
    expect(_round_trip(url, "What is 12 plus 30?", "any").calls, "no tool ran")


@scenario(LIB)
def bind_tools_named(url: str) -> None:
    expect(_round_trip(url, "Tell me about Lima's weather.", "get_weather").called("get_weather"), "not called")


@scenario(LIB)
def streamed_tool_call(url: str) -> None:
    """The chunks of a streamed call add up to a message with whole tool calls (tool_call_chunks merged)."""
    log = ToolLog()
    tools = _tools(log)
    llm = _llm(url).bind_tools(tools)
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage("What is the weather in Seoul?")]
    gathered = None
    for chunk in llm.stream(messages):
        gathered = chunk if gathered is None else gathered + chunk
    expect(gathered is not None and gathered.tool_calls, f"no streamed tool call ({gathered!r:.120})")
    messages += [gathered, *_run_tools(tools, gathered)]
    text = "".join(str(c.content) for c in llm.stream(messages))
    answered(text)


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="The person's full name")
    age: int = Field(description="Age in years")


@scenario(LIB)
def structured_output_json_schema(url: str) -> None:
    out = _llm(url).with_structured_output(Person, method="json_schema").invoke("Alan Turing died aged 41.")
    expect(isinstance(out, Person) and out.age == 41, f"got {out!r}")


@scenario(LIB)
def structured_output_function_calling(url: str) -> None:
    out = _llm(url).with_structured_output(Person, method="function_calling").invoke("Ada Lovelace was 36.")
    expect(isinstance(out, Person) and out.age == 36, f"got {out!r}")


@scenario(LIB)
def multi_turn_cached(url: str) -> None:
    """Three turns on a long system prompt; langchain reports the server's cached tokens as `cache_read`."""
    log = ToolLog()
    tools = _tools(log)
    llm = _llm(url).bind_tools(tools)
    messages: list[BaseMessage] = [SystemMessage(LONG_SYSTEM)]
    reads = []
    for question in ("What is the weather in Nairobi?", "And in Quito?", "Thanks. Which city was first?"):
        messages.append(HumanMessage(question))
        for _ in range(3):
            ai = llm.invoke(messages)
            usage = ai.usage_metadata or {}
            reads.append(usage.get("input_token_details", {}).get("cache_read", 0))
            messages.append(ai)
            if not ai.tool_calls:
                break
            messages += _run_tools(tools, ai)
        expect(not ai.tool_calls, f"still calling after 3 requests on {question!r}")
        answered(ai.content)
    expect(log.called("get_weather"), "get_weather never called")
    expect(max(reads[1:], default=0) > 0, f"no cache reads reported on later turns: {reads}")
