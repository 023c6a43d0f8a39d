"""/v1/responses with the official openai SDK on the tiny model (random weights: grammars make outputs parse):
create and stream, a function-tool round trip, previous_response_id over three turns with cached tokens, retrieve
and delete, the store's bounds, and bad input as 4xx in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.response_store import ResponseStore
from radixserve.server.responses_protocol import ResponseObject, TextConfig
from sdk_python import run_client, sdk_python
from test_structured_server import TOOLS
from server_fixtures import client, engine, http, model, server  # noqa: F401  (fixtures)

WEATHER = {"type": "function", **TOOLS[0]["function"]}  # the chat tests' tool, as Responses names it
YES_NO = {
    "format": {
        "type": "json_schema",
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"ok": {"enum": ["yes", "no"]}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    }
}


def test_create_with_instructions_and_a_json_schema(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default", instructions="Answer in JSON.", input="Is the sky blue?", text=YES_NO, temperature=0
    )
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert json.loads(r.output_text)["ok"] in ("yes", "no")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in JSON."


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    # seeded: unseeded, the random weights sampled the end of text within 3 tokens ~3 times in 150
    r = client.responses.create(
        model="default", input="Tell a long story.", max_output_tokens=3, temperature=0.5, extra_body={"seed": 7}
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stream_sends_the_typed_events(client: openai.OpenAI) -> None:
    with client.responses.stream(model="default", input="Is it?", text=YES_NO, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done"):
        assert kind in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and json.loads(deltas)["ok"] in ("yes", "no")
    assert final.usage.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model="default", tools=[WEATHER], tool_choice="required", temperature=0, parallel_tool_calls=False)
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with client.responses.stream(input=items, **kw) as s:
            kinds = [e.type for e in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(input=items, **kw)
    [call] = [o for o in first.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and call.call_id and set(args) == {"city", "unit"}
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp": 21})})
    final = client.responses.create(input=items, tools=[WEATHER], tool_choice="none", model="default", text=YES_NO)
    assert final.status == "completed" and not [o for o in final.output if o.type == "function_call"]
    assert final.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_over_three_turns_reports_cached_tokens(client: openai.OpenAI) -> None:
    turn = client.responses.create(model="default", input="Remember the number 7.", max_output_tokens=8, temperature=0)
    assert turn.usage.input_tokens_details.cached_tokens == 0 or turn.usage.input_tokens > 0
    for text in ("And the number 8?", "What were they?"):
        previous = turn
        turn = client.responses.create(
            model="default", input=text, previous_response_id=previous.id, max_output_tokens=8, temperature=0
        )
        assert turn.previous_response_id == previous.id
        # the new turn's prompt holds the whole conversation, and everything before the new input is cached
        assert turn.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
        assert turn.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens - 4  # within a page


def test_retrieve_and_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="default", input="x", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_prompt_cache_fields_are_accepted_and_reported(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default",
        input="Hi",
        max_output_tokens=2,
        prompt_cache_key="user-42",
        extra_body={"prompt_cache_retention": "24h"},
    )
    assert r.prompt_cache_key == "user-42" and r.prompt_cache_retention == "24h"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "bogus": 1}, "bogus"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].image_url"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": []}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 3}}}},
            "text.format",
        ),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape(http: httpx.Client, body: dict, param: str) -> None:
    for stream in (False, True):
        r = http.post("/v1/responses", json={**body, "stream": stream})
        assert 400 <= r.status_code < 500, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"], err


def test_get_and_delete_of_a_missing_id_are_404(http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        r = http.request(method, "/v1/responses/resp_nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def _stored(rid: str) -> ResponseObject:
    return ResponseObject(
        rid, 0, "m", "completed", [], None, None, None, None, {}, True, None, None, None, "auto", [], TextConfig(),
        True, None, None, None, "disabled", None,
    )  # fmt: skip


def test_store_bounds_by_count_bytes_and_ttl_and_by_tenant() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10, max_bytes=10_000, clock=lambda: now[0])
    for i in range(3):
        store.put("a", _stored(f"r{i}"), [])
    assert store.get("a", "r0") is None and store.get("a", "r2") is not None and len(store) == 2
    assert store.get("b", "r2") is None  # another tenant's id is as missing as an unknown one
    now[0] = 11.0
    assert store.get("a", "r2") is None and len(store) == 0
    from radixserve.server.protocol import ChatMessage

    big = [ChatMessage(role="user", content="x" * 6000)]
    store.put("a", _stored("x"), big)
    store.put("a", _stored("y"), big)
    assert store.get("a", "x") is None and store.get("a", "y") is not None  # bytes: the oldest went


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_openai_agents_sdk_tool_round_trip(server: BackgroundServer, mode: str) -> None:
    """The openai-agents SDK's default model speaks the Responses API: the tool call, its output sent back, an
    answer; the SDK raises on any exchange it cannot read."""
    out = run_client(sdk_python("agents"), "agents_client.py", server.url, mode)
    assert out["calls"] and out["calls"][0]["city"]
    assert out["items"][:2] == ["tool_call_item", "tool_call_output_item"] and out["items"][-1] == "message_output_item"
    first, last = out["responses"][0], out["responses"][-1]
    assert first["output"] == ["function_call"] and "function_call" not in last["output"]
    assert isinstance(out["final_output"]["sunny"], bool) and len(out["responses"]) >= 2
    if mode == "streamed":
        assert "raw_response_event" in out["stream_events"] and "run_item_stream_event" in out["stream_events"]


def test_stored_responses_belong_to_their_key(engine: Engine) -> None:
    with BackgroundServer(build_app(engine, api_key=["sk-alice", "sk-bob"])) as srv:
        alice = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-alice", max_retries=0, timeout=60)
        bob = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-bob", max_retries=0, timeout=60)
        r = alice.responses.create(model="default", input="Hi", max_output_tokens=2)
        assert alice.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="default", input="x", previous_response_id=r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(r.id)
        alice.responses.delete(r.id)
