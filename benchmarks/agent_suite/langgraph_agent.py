"""langgraph as its quickstarts build agents on a ChatOpenAI pointed at our base URL: the prebuilt ReAct agent, the
same loop built by hand (StateGraph, ToolNode, tools_condition), a ReAct agent with a `response_format`, a streamed
run, and a two-turn thread kept by a checkpointer."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, create_react_agent, tools_condition
from pydantic import BaseModel

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import MAX_TOKENS, MODEL, SYSTEM, ToolLog, answered, scenario

LIB = "langgraph"
LIMIT = {"recursion_limit": 8}  # model, tools, model, ... : a loop ends as GraphRecursionError, not a hang


def _llm(url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS, max_retries=0)


def _weather(log: ToolLog) -> Any:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return log.get_weather(city)

    return get_weather


def _completed(messages: list[BaseMessage], log: ToolLog) -> None:
    """A call came with valid arguments (the tool checked them), its ToolMessage went back, and an answer ended it."""
    expect(log.called("get_weather"), f"get_weather not called ({[type(m).__name__ for m in messages]})")
    expect(any(isinstance(m, ToolMessage) for m in messages), "no tool result in the thread")
    last = messages[-1]
    expect(isinstance(last, AIMessage) and not last.tool_calls, f"the run ended on {type(last).__name__}")
    answered(last.content)


def _react(url: str, log: ToolLog, **kw: Any) -> Any:
    return create_react_agent(_llm(url), [_weather(log)], prompt=SYSTEM, **kw)


@scenario(LIB)
def react_agent(url: str) -> None:
    log = ToolLog()
    out = _react(url, log).invoke({"messages": [("user", "What is the weather in Sydney?")]}, LIMIT)
    _completed(out["messages"], log)


class State(TypedDict):
    messages: Annotated[list[BaseMessage], add_messages]


@scenario(LIB)
def hand_built_graph(url: str) -> None:
    """The loop of langgraph's "build a basic chatbot" tutorial with tools: chatbot -> tools -> chatbot."""
    log = ToolLog()
    tools = [_weather(log)]
    llm = _llm(url).bind_tools(tools)

    def chatbot(state: State) -> dict:
        return {"messages": [llm.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    graph = StateGraph(State)
    graph.add_node("chatbot", chatbot)
    graph.add_node("tools", ToolNode(tools))
    graph.add_conditional_edges("chatbot", tools_condition)
    graph.add_edge("tools", "chatbot")
    graph.add_edge(START, "chatbot")
    out = graph.compile().invoke({"messages": [("user", "How is the weather in Toronto?")]}, LIMIT)
    _completed(out["messages"], log)


class WeatherReport(BaseModel):
    city: str
    summary: str


@scenario(LIB)
def react_agent_response_format(url: str) -> None:
    """After the loop, the prebuilt agent asks for a structured response (with_structured_output)."""
    log = ToolLog()
    agent = _react(url, log, response_format=WeatherReport)
    out = agent.invoke({"messages": [("user", "Check the weather in Lima and report it.")]}, LIMIT)
    _completed(out["messages"], log)
    report = out.get("structured_response")
    expect(isinstance(report, WeatherReport) and report.city, f"structured_response {report!r}")


@scenario(LIB)
def streamed_updates(url: str) -> None:
    log = ToolLog()
    steps = []
    final: list[BaseMessage] = []
    stream = _react(url, log).stream({"messages": [("user", "Weather in Mumbai?")]}, LIMIT, stream_mode="values")
    for state in stream:
        steps.append(len(state["messages"]))
        final = state["messages"]
    expect(len(steps) >= 3, f"only {len(steps)} streamed states")
    _completed(final, log)


@scenario(LIB)
def checkpointed_thread(url: str) -> None:
    """Two turns on one thread_id: the checkpointer brings the first turn back into the second."""
    log = ToolLog()
    agent = _react(url, log, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}, **LIMIT}
    agent.invoke({"messages": [("user", "What is the weather in Havana?")]}, config)
    out = agent.invoke({"messages": [("user", "And in Montreal?")]}, config)
    expect(len(log.called("get_weather")) >= 2, f"the second turn made no call (calls {log.calls})")
    expect(sum(isinstance(m, ToolMessage) for m in out["messages"]) >= 2, "the thread lost the first turn")
    _completed(out["messages"], log)
