"""The HTTP server's native endpoints, bad input, disconnects and concurrency (httpx for raw bodies, SSE and
disconnects; one tiny engine behind a live uvicorn per module: tests/server_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_checks import wait_idle
from radixserve import Engine
from radixserve.server.background import BackgroundServer
from server_fixtures import GREEDY, MAX_BODY, MESSAGES, sse_events
from server_fixtures import client, engine, http, model, server  # noqa: F401  (fixtures)

# ---------------------------------------------------------------- native endpoints


def test_generate_native(http: httpx.Client, engine: Engine) -> None:
    sp = {"max_new_tokens": 5, **GREEDY}
    ref = engine.generate("Hello, world!", sp)
    one = http.post("/generate", json={"text": "Hello, world!", "sampling_params": sp}).json()
    assert one["text"] == ref["text"] and one["output_ids"] == ref["output_ids"]
    assert set(one["meta_info"]) >= {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    batch = http.post(
        "/generate",
        json={"input_ids": [engine.encode("Hello, world!"), engine.encode("import torch")], "sampling_params": sp},
    ).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == ref["output_ids"]
    lp = http.post(
        "/generate",
        json={
            "text": "Hello, world!",
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()["meta_info"]
    n_prompt = ref["meta_info"]["prompt_tokens"]
    assert len(lp["input_token_logprobs"]) == n_prompt and lp["input_token_logprobs"][0][0] is None
    assert len(lp["output_token_logprobs"]) == 5 and len(lp["output_top_logprobs"][0]) == 2
    assert lp["output_token_logprobs"][0][2] == engine.tokenizer.token_to_str(ref["output_ids"][0])
    with http.stream(
        "POST",
        "/generate",
        json={"text": "Hello, world!", "sampling_params": sp, "stream": True, "return_logprob": True},
    ) as s:
        events = sse_events(s.iter_lines())
    # as SGLang's server by default: each event holds everything so far, the last one has the finish reason
    assert events[-1]["output_ids"] == ref["output_ids"] and events[-1]["text"] == ref["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))
    assert [e["meta_info"]["completion_tokens"] for e in events] == sorted(
        e["meta_info"]["completion_tokens"] for e in events
    )
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [len(e["output_ids"]) for e in events]
    assert events[-1]["meta_info"]["output_token_logprobs_length"] == 5
    prefill = http.post("/generate", json={"text": "Hello, world!", "sampling_params": {"max_new_tokens": 0}}).json()
    assert prefill["output_ids"] == [] and prefill["meta_info"]["completion_tokens"] == 0


def test_tokenize_detokenize(http: httpx.Client, engine: Engine) -> None:
    text = "Hello, world! 你好"
    r = http.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == engine.encode(text) and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_cache_salt_isolates(http: httpx.Client) -> None:
    body = {"text": "A radix tree stores prefixes of token sequences. " * 3, "sampling_params": {"max_new_tokens": 1}}

    def cached(salt: str) -> int:
        return http.post("/generate", json={**body, "cache_salt": salt}).json()["meta_info"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0  # same text, another namespace: no shared pages


def test_info_health_models_flush(http: httpx.Client, engine: Engine, model: str) -> None:
    assert http.get("/health").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["context_length"] == engine.context_length and info["served_model_name"] == model
    assert info["chat_template"] == engine.tokenizer.chat_template
    assert info["special_tokens"]["eos_token"] == engine.tokenizer.eos_token
    wait_idle(engine)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert engine.cache_stats()["cached_pages"] == 0


def test_metrics(http: httpx.Client, client: openai.OpenAI, model: str) -> None:
    def scrape() -> dict[str, float]:
        text = http.get("/metrics").text
        return {
            s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    before = scrape()
    for name in [
        "radixserve_hit_rate",
        "radixserve_cached_pages",
        "radixserve_evictable_pages",
        "radixserve_free_pages",
        "radixserve_num_running",
        "radixserve_num_waiting",
        "radixserve_num_retractions_total",
        "radixserve_time_to_first_token_seconds_count",
        "radixserve_inter_token_latency_seconds_count",
        "radixserve_e2e_request_latency_seconds_count",
    ]:
        assert name + "{}" in before, name
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    after = scrape()
    for name in [
        "radixserve_prompt_tokens_total",
        "radixserve_generation_tokens_total",
        "radixserve_time_to_first_token_seconds_count",
        "radixserve_e2e_request_latency_seconds_count",
        "radixserve_inter_token_latency_seconds_count",
    ]:
        assert after[name + "{}"] > before.get(name + "{}", 0), name
    key = 'radixserve_http_requests_total{"route": "/v1/chat/completions", "status": "200"}'
    assert after[key] == before.get(key, 0) + 1


# ---------------------------------------------------------------- bad input

BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].image_url",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ""}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        },
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 1100}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens"),  # the field sent
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "fox " * 1100, "max_tokens": 1}, 400, "prompt"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("/generate", {"input_ids": [[1, 2], [3]], "stream": True}, 400, "stream"),
    ("/generate", {"input_ids": [-1]}, 400, "input_ids"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p}:{s}:{q}" for p, _, s, q in BAD])
def test_bad_input_gets_error_body(
    http: httpx.Client, client: openai.OpenAI, model: str, path: str, body: Any, status: int, param: str | None
) -> None:
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if status == 400:
        assert err["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_sdk_raises_on_bad_input(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert exc.value.body["param"] == "temperature"  # type: ignore[index]


def test_body_too_large(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = http.post("/v1/completions", content=chunked())
    assert r.status_code == 413
    assert http.get("/health").status_code == 200


def test_unknown_route_has_error_body(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/chat/completions").status_code == 405


# ---------------------------------------------------------------- disconnects and concurrency

STREAMS = [
    ("/v1/completions", {"prompt": "The quick brown fox"}, 1),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 3, "seed": 5, "temperature": 1.0}, 3),
    ("/generate", {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, 1),
]


@pytest.mark.parametrize("path,body,n", STREAMS, ids=[p for p, _, _ in STREAMS])
def test_disconnect_mid_stream_aborts(server: BackgroundServer, engine: Engine, path: str, body: dict, n: int) -> None:
    wait_idle(engine)
    before = engine.metrics()["generation_tokens_total"]
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, **body, "stream": True}
    if path == "/generate":
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "ignore_eos", "temperature")}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", path, json=body) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
    # the connection is closed: the server notices, and the engine drops the request(s)
    wait_idle(engine)
    assert engine.metrics()["generation_tokens_total"] - before < 400 * n
    engine.check_invariants()


def test_disconnect_non_streaming_aborts(server: BackgroundServer, engine: Engine) -> None:
    wait_idle(engine)
    before = engine.metrics()["generation_tokens_total"]
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=0.1) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    wait_idle(engine)
    assert engine.metrics()["generation_tokens_total"] - before < 400
    engine.check_invariants()


def test_50_concurrent_streams_match_engine(server: BackgroundServer, engine: Engine, model: str) -> None:
    prompts = [f"Request {i}: the fox number {i * 7} jumps" for i in range(50)]
    refs = [engine.generate(p, {"max_new_tokens": 6, **GREEDY})["text"] for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        text, finished = "", False
        async for chunk in stream:
            text += chunk.choices[0].text
            finished = finished or chunk.choices[0].finish_reason is not None
        assert finished
        return text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(run()) == refs
    wait_idle(engine)
    engine.check_invariants()
