"""A tool-using agent loop over the OpenAI API (the openai SDK, unchanged): the model calls tools, the program runs
them and sends the results back as `tool` messages, until the model answers. Each turn's prompt extends the last
one, so it is served mostly from the radix cache.

    python examples/tool_agent.py [--model PATH | --url http://127.0.0.1:30000] [--stream]

With --model (or the default model) a server is started in-process on a free port.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from common import HitRate, parse_args

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as (3 + 4) * 2.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 40}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "population",
            "description": "The population of a city, in millions.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
POPULATION = {"paris": 2.1, "tokyo": 14.0, "lagos": 15.4, "lima": 10.1}
OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}
QUESTION = "How many people live in Paris and Tokyo together, in millions?"
MAX_TURNS = 4


def calculate(expr: str) -> float:
    """Arithmetic only: numbers, + - * / and parentheses (never eval)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError("not arithmetic")

    return walk(ast.parse(expr, mode="eval").body)


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        if name == "calculator":
            return json.dumps({"result": calculate(args["expression"])})
        city = args["city"].strip().lower()
        return json.dumps({"millions": POPULATION[city]} if city in POPULATION else {"error": f"unknown city {city}"})
    except Exception as exc:  # noqa: BLE001 - a bad call is the model's to read and fix
        return json.dumps({"error": str(exc)})


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], tool_choice: Any, stream: bool) -> dict[str, Any]:
    """One turn: the assistant message as a dict (content and tool_calls), streamed or not."""
    kw = dict(model="default", messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls or []
        ]
        return {"role": "assistant", "content": msg.content, "tool_calls": calls}
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls or []:  # id and name come first, then argument fragments
            c = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": "", "arguments": ""}})
            c["function"]["name"] += d.function.name or ""
            c["function"]["arguments"] += d.function.arguments or ""
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


@contextmanager
def open_server(args: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, something with cache_stats()) of --url, or of a server started here on --model."""
    if args.url:
        import frontend_dsl as sgl

        yield args.url, sgl.RuntimeEndpoint(args.url, api_key=args.api_key)
        return
    from radixserve import Engine
    from radixserve.server.app import build_app
    from radixserve.server.background import BackgroundServer

    with Engine(model=args.model) as engine, BackgroundServer(build_app(engine)) as server:
        yield server.url, engine


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], {"--stream": {"action": "store_true", "help": "stream every turn"}})
    with open_server(args) as (url, stats):
        client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "unused", max_retries=0, timeout=600)
        rate = HitRate(stats)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        for turn in range(MAX_TURNS):
            # The first turn must call a tool; later ones may answer; the last must answer.
            choice = "required" if turn == 0 else ("none" if turn == MAX_TURNS - 1 else "auto")
            msg = ask(client, messages, choice, args.stream)
            messages.append(msg)
            if not msg["tool_calls"]:
                print(f"answer: {msg['content']!r}")
                break
            for call in msg["tool_calls"]:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                print(f"call {call['function']['name']}({call['function']['arguments']}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        print(rate.report())


if __name__ == "__main__":
    main()
