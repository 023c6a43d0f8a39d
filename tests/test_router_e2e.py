"""End to end: two tiny radixserve replicas (each its own engine and HTTP server) behind the router, driven by the
openai SDK as a client of the router would be."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_checks import engine_left_at_rest, wait_idle
from radixserve.router.app import build_router_app
from radixserve.router.proxy import WORKER_HEADER
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

PAGE = 4
SYSTEM = {"role": "system", "content": "You are terse."}
QUESTIONS = ["Hi there!", "Tell me more.", "Why?"]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[list]:
    with (
        engine_left_at_rest(tiny_model_dir, dtype="float32", page_size=PAGE, max_total_tokens=4096) as e1,
        engine_left_at_rest(tiny_model_dir, dtype="float32", page_size=PAGE, max_total_tokens=4096) as e2,
        BackgroundServer(build_app(e1)) as s1,
        BackgroundServer(build_app(e2)) as s2,
    ):
        yield [(e1, s1), (e2, s2)]


@pytest.fixture(scope="module")
def router(replicas: list) -> Iterator[BackgroundServer]:
    app = build_router_app([srv.url for _, srv in replicas])
    try:
        with BackgroundServer(app) as srv:
            yield srv
    finally:
        app.state.close()


@pytest.fixture(scope="module")
def client(router: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def converse(client: openai.OpenAI, model: str, opening: str, turns: int) -> tuple[set[str], list[int], list[int]]:
    """One conversation of `turns` turns; the workers that answered it, cached tokens per turn, context per turn."""
    messages = [SYSTEM, {"role": "user", "content": opening}]
    homes, cached, contexts = set(), [], []
    for turn in range(turns):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        r = raw.parse()
        homes.add(raw.headers[WORKER_HEADER])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        contexts.append(r.usage.prompt_tokens + r.usage.completion_tokens)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]},
        ]
    return homes, cached, contexts


def test_conversations_stick_to_a_replica_and_hit_its_cache(client: openai.OpenAI, model: str, replicas: list) -> None:
    openings = [
        "Write a haiku about radix trees and their many branches.",
        "List three prime numbers, then explain why each of them is prime.",
        "Describe a quiet harbour at dawn in two long sentences, please.",
        "What is the capital of a country that does not exist yet?",
    ]
    used = set()
    for opening in openings:
        homes, cached, contexts = converse(client, model, opening, turns=3)
        assert len(homes) == 1, homes  # the whole conversation on one replica
        used |= homes
        for turn in range(1, 3):  # all of the previous turn's computed KV, in full pages, came from the cache
            assert cached[turn] >= (contexts[turn - 1] - 1) // PAGE * PAGE, (opening, cached, contexts)
    assert used == {srv.url for _, srv in replicas}, httpx.get(str(client.base_url).replace("/v1/", "/workers")).text


def test_streaming_through_the_router_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Count to five, slowly and carefully, one number per line."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same replica served both
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    streamed = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_router_metrics_sum_the_replicas(
    router: BackgroundServer, client: openai.OpenAI, model: str, replicas: list
) -> None:
    client.chat.completions.create(
        model=model, messages=[SYSTEM, {"role": "user", "content": "metrics"}], max_tokens=2, temperature=0
    )
    for eng, _ in replicas:
        wait_idle(eng)
    text = httpx.get(router.url + "/metrics", timeout=30).text
    total = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    stats = [eng.metrics() for eng, _ in replicas]
    assert total["radixserve_prompt_tokens_total"] == sum(m["prompt_tokens_total"] for m in stats)
    assert total["radixserve_cached_tokens_total"] == sum(m["cached_tokens_total"] for m in stats)
    assert total["radixserve_hit_rate"] == pytest.approx(
        sum(m["cached_tokens_total"] for m in stats) / sum(m["prompt_tokens_total"] for m in stats)
    )


def test_removed_replica_gets_no_requests_and_can_come_back(
    router: BackgroundServer, client: openai.OpenAI, model: str, replicas: list
) -> None:
    admin = httpx.Client(base_url=router.url, timeout=30)
    gone = replicas[0][1].url
    assert admin.delete("/workers", params={"url": gone}).status_code == 200
    try:
        for i in range(3):
            homes, _, _ = converse(client, model, f"Conversation number {i} after a replica left.", turns=1)
            assert homes == {replicas[1][1].url}
        r = admin.post("/generate", json={"text": "native route", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == replicas[1][1].url
    finally:
        assert admin.post("/workers", json={"url": gone}).json()["worker"]["healthy"]
    listed = admin.get("/workers").json()["workers"]
    assert {w["url"] for w in listed} == {srv.url for _, srv in replicas} and all(w["load"] == 0 for w in listed)
