"""A thinking model's reasoning on the agent APIs: split from the answer in any pieces (radixserve/server/reasoning.py),
a Responses `reasoning` item and an Anthropic `thinking` block, whole and streamed, on the tiny model with a
template whose generation prompt opens `<think>` (Qwen3's shape); a model that does not think has none."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.constrained.grammar import GrammarMatcher, built
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.chat_output import response_message
from radixserve.server.reasoning import ThinkSplit, split_reasoning
from radixserve.server.tool_calls import tool_format
from radixserve.server.tool_grammar import after_reasoning, call_grammar

OPEN_THINK = "{{- '<|im_start|>assistant\\n<think>\\n' if enable_thinking is not defined or enable_thinking else "
CLOSED_THINK = "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"


@pytest.mark.parametrize(
    "text,inside,reasoning,answer",
    [
        ("<think>plan</think>\n\nSure.", False, "plan", "Sure."),
        ("  <think>a<b</think>c", False, "a<b", "c"),
        ("plan</think>\n\nSure.", True, "plan", "Sure."),
        ("still thinking", True, "still thinking", ""),
        ("no block <think>x</think>", False, "", "no block <think>x</think>"),
        ("<thin", False, "", "<thin"),
    ],
)
def test_split_in_any_pieces(text: str, inside: bool, reasoning: str, answer: str) -> None:
    assert split_reasoning(text, ThinkSplit(inside)) == (reasoning, answer)
    for size in (1, 2, 3, 5):
        s = ThinkSplit(inside)
        parts = [p for i in range(0, len(text), size) for p in s.feed(text[i : i + size])] + s.finish()
        assert "".join(t for k, t in parts if k == "reasoning") == reasoning, (size, parts)
        assert "".join(t for k, t in parts if k == "content") == answer, (size, parts)


@pytest.fixture(scope="module")
def thinking_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace(
        "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}", OPEN_THINK + CLOSED_THINK + "\n{%- endif %}"
    )
    assert "</think>" in config["chat_template"]
    config_path.write_text(json.dumps(config))
    with engine_left_at_rest(model, dtype="float32", max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def thinking_server(thinking_engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(thinking_engine)) as srv:
        yield srv


def test_responses_reasoning_item_whole_and_streamed(thinking_server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="default", input="Think.", max_output_tokens=5, temperature=0)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text  # a block never closed
    with client.responses.stream(**kw) as s:
        events = list(s)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text
    assert "response.reasoning_text.done" in [e.type for e in events]
    assert [o["type"] for o in events[-1].response.model_dump()["output"]] == ["reasoning"]


def test_messages_thinking_block_whole_and_streamed(thinking_server: BackgroundServer) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 5, "temperature": 0}
    m = httpx.post(thinking_server.url + "/v1/messages", json=body, timeout=60).json()
    assert [b["type"] for b in m["content"]] == ["thinking"] and m["content"][0]["thinking"]
    with httpx.stream("POST", thinking_server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert data[2]["type"] == "content_block_start" and data[2]["content_block"]["type"] == "thinking"
    thought = "".join(d["delta"]["thinking"] for d in data if d.get("delta", {}).get("type") == "thinking_delta")
    assert thought == m["content"][0]["thinking"]


def test_thinking_turned_off_gives_an_answer(thinking_server: BackgroundServer) -> None:
    """Anthropic's thinking.type disabled and OpenAI's reasoning.effort none reach the template as enable_thinking
    false: it closes the block itself, so the output is all answer. Greedy: a sampled first token can be the end of
    the turn on the random model, which leaves no item to check."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.responses.create(
        model="default", input="Hi", max_output_tokens=5, reasoning={"effort": "none"}, temperature=0
    )
    assert [o.type for o in r.output] == ["message"]
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    m = httpx.post(thinking_server.url + "/v1/messages", json={**body, "thinking": {"type": "disabled"}}, timeout=60)
    assert [b["type"] for b in m.json()["content"]] == ["text"], m.text
    on = {"type": "enabled", "budget_tokens": 1024}
    m = httpx.post(thinking_server.url + "/v1/messages", json={**body, "thinking": on}, timeout=60)
    assert [b["type"] for b in m.json()["content"]] == ["thinking"], m.text


def test_chat_completions_take_chat_template_kwargs(thinking_server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    lengths = [
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": on}},
        ).usage.prompt_tokens
        for on in (True, False)
    ]
    assert lengths[1] > lengths[0]  # off: the template writes the closed block `<think>\n\n</think>\n\n` itself


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": 1}, {"add_generation_prompt": False}, {"x": {"y": 1}}])
def test_bad_chat_template_kwargs_are_400(thinking_server: BackgroundServer, kwargs: dict) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "chat_template_kwargs": kwargs}
    r = httpx.post(thinking_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == (200 if "x" in kwargs else 400), r.text  # a variable the template ignores is harmless


def _chat(client: openai.OpenAI, stream: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a short greedy chat answer, whole or joined from the stream's deltas."""
    kw = dict(model="default", messages=[{"role": "user", "content": "Think."}], max_tokens=5, temperature=0)
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        return getattr(message, "reasoning_content", None), message.content
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning or None, "".join(d.content or "" for d in deltas)


def test_chat_completions_reasoning_content_whole_and_streamed(thinking_server: BackgroundServer) -> None:
    """Chat Completions had no reasoning field: a thinking model's reasoning came back as its answer."""
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reasoning, content = _chat(client, stream=False)
    assert reasoning and not content  # 5 tokens: the block the template opened never closed
    assert _chat(client, stream=True) == (reasoning, "")


def test_reasoning_parser_none_leaves_the_output_whole(thinking_engine: Engine) -> None:
    with BackgroundServer(build_app(thinking_engine, reasoning_parser="none")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reasoning, content = _chat(client, stream=False)
        assert reasoning is None and content
        assert _chat(client, stream=True) == (None, content)
    with pytest.raises(ValueError, match="reasoning_parser"):
        build_app(thinking_engine, reasoning_parser="r1")


def test_a_required_call_comes_after_the_reasoning_the_template_opened(thinking_engine: Engine) -> None:
    """Qwen3's template opens `<think>` for the model: a call grammar that began at the first token forced the call
    into the reasoning block (where it is no call). Now the reasoning runs free until `</think>`, then the call."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    fmt = tool_format(thinking_engine.tokenizer, frozenset({"ping"}))
    assert fmt is not None
    grammar = after_reasoning(call_grammar(fmt, tools, None), fmt)
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    matcher = GrammarMatcher(
        built(thinking_engine.grammars.compile("ebnf", grammar)), thinking_engine.model_info()["vocab_size"]
    )
    assert all(matcher.accept(t) for t in thinking_engine.tokenizer.encode("plan</think>\n\n" + call))
    assert matcher.ll.is_accepting()
    message, called = response_message("plan</think>\n\n" + call, fmt, think=ThinkSplit(inside=True))
    assert called and message.reasoning_content == "plan" and message.tool_calls[0].function.name == "ping"
    with BackgroundServer(build_app(thinking_engine)) as srv:  # random weights: the reasoning is all it writes
        # seeded: unseeded, the random weights sampled no reasoning at all (None) in some runs
        body = {
            "messages": [{"role": "user", "content": "Ping."}],
            "tools": tools,
            "tool_choice": "required",
            "seed": 7,
        }
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=60).json()
    assert not r["choices"][0]["message"]["reasoning_content"].startswith("<tool")  # (the grammar forced it there)
