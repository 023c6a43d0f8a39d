"""A turn that only repeats the call whose result the request sends back is asked again for an answer
(call_stop.answer_after_echo): the agent suite's default-model runs ended such turns with no content at all, on the
Chat Completions, Responses and (streamed) agent paths. The tiny model is made to echo by a named tool whose one
possible call is the answered one (its argument an enum of one value)."""

from __future__ import annotations

import json

import openai
import pytest

from radixserve.server.tool_calls import ToolFormat, ToolStream, call_key
from server_fixtures import client, engine, server  # noqa: F401 - fixtures

ONLY_OSLO = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ARGS = json.dumps({"city": "Oslo"})
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
KW = dict(
    model="default",
    messages=MESSAGES,
    tools=[ONLY_OSLO],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},  # its one call: the echo
    parallel_tool_calls=False,
    max_tokens=120,  # the tiny tokenizer spells the echo in many pieces
    temperature=0,
)


def test_an_echo_alone_is_answered_again(client: openai.OpenAI) -> None:  # noqa: F811
    r = client.chat.completions.create(**KW)  # type: ignore[call-overload]
    message = r.choices[0].message
    assert message.tool_calls is None and message.content, message  # was: no calls, content None
    assert not message.content.lstrip().startswith(("{", "<", "[", "(", "`")), message.content


def test_a_streamed_echo_alone_is_answered_again_with_the_same_text(client: openai.OpenAI) -> None:  # noqa: F811
    whole = client.chat.completions.create(**KW).choices[0].message.content  # type: ignore[call-overload]
    text, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **KW):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            reason = chunk.choices[0].finish_reason or reason
    assert text and not calls and reason in ("stop", "length")
    assert text.strip() == whole


def test_a_responses_echo_alone_is_answered_again(client: openai.OpenAI) -> None:  # noqa: F811
    tool = {"type": "function", **ONLY_OSLO["function"]}
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    kw = dict(model="default", input=items, tools=[tool], max_output_tokens=120, temperature=0)
    choice = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(tool_choice=choice, **kw)  # type: ignore[arg-type]
    assert [o.type for o in whole.output] == ["message"] and whole.output_text, whole.output
    streamed = ""
    for event in client.responses.create(tool_choice=choice, stream=True, **kw):  # type: ignore[arg-type]
        if event.type == "response.output_text.delta":
            streamed += event.delta
    assert streamed.strip() == whole.output_text.strip()


@pytest.mark.parametrize(
    ("text", "echo_only"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n', True),
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}} It is sunny.', False),  # an answer follows
        ('{"name": "get_weather", "arguments": {"city": "Rome"}}', False),  # a new call
        ("It is sunny.", False),
    ],
)
def test_echo_only_is_a_turn_of_answered_calls_and_nothing_else(text: str, echo_only: bool) -> None:
    fmt = ToolFormat(None, frozenset({"get_weather"}), answered=frozenset({call_key("get_weather", ARGS)}))  # type: ignore[arg-type]
    stream = ToolStream(fmt)
    stream.feed(text)
    stream.finish()
    assert stream.echo_only is echo_only


class _Gap:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [9] * len(text)


def _ended(ids: list[int], stop: int | None) -> object:
    from radixserve.io import FinishReason, GenerateOutput, OutputMeta

    meta = OutputMeta(
        id="r",
        prompt_tokens=0,
        completion_tokens=len(ids),
        cached_tokens=0,
        finish_reason=FinishReason("stop", stop),
        ttft=None,
        e2e_latency=0.0,
    )
    return GenerateOutput("", ids, meta)


def test_the_answer_after_an_echo_starts_a_turn_of_its_own_where_the_template_has_one() -> None:
    from radixserve.server.call_stop import _continued

    end, header = 2, [7, 8]  # the stop token (<|im_end|>), the assistant header after it in the prompt
    prompt = [1, 5, end, 6, end, *header]
    assert _continued(_Gap(), prompt, _ended([4, 4, end], end)) == prompt + [4, 4, end, *header]  # type: ignore[arg-type]
    # no stop token in the prompt, or a tail too long to be a header: the echo without its stop, a blank line
    assert _continued(_Gap(), [1, 5], _ended([4, end], end)) == [1, 5, 4, 9, 9]  # type: ignore[arg-type]
    long_tail = [1, end, *range(10, 30)]
    assert _continued(_Gap(), long_tail, _ended([4, end], end)) == [*long_tail, 4, 9, 9]  # type: ignore[arg-type]
