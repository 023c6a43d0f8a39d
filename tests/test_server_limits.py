"""The server under trouble: API keys and tenants, a full queue (429), clients leaving while queued, a small KV pool.

One tiny engine that runs one request at a time (so others queue) over a 512-token pool, served with two API keys
and at most 2 waiting requests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from engine_checks import engine_left_at_rest, wait_idle
from radixserve import Engine
from radixserve.errors import QueueFullError
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.errors import ApiError
from radixserve.server.serving import engine_errors

KEYS = ("key-one", "key-two")
POOL_TOKENS = 512
LONG = {"prompt": "The quick brown fox", "max_tokens": 450, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    # Speculation off: the long request must keep the only slot busy; accepted drafts would end it in a few steps.
    with engine_left_at_rest(
        tiny_model_dir,
        dtype="float32",
        page_size=4,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=1,
        speculative="off",
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine, api_key=",".join(KEYS), max_queued_requests=2)) as srv:
        yield srv


def http(server: BackgroundServer, key: str | None = KEYS[0], timeout: float = 60) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


def wait_for(engine: Engine, key: str, value: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.metrics()[key] != value:
        assert time.monotonic() < deadline, f"{key} never reached {value}: {engine.metrics()}"
        time.sleep(0.01)


class Running:
    """A long streaming request holding the engine's only running slot until closed."""

    def __init__(self, server: BackgroundServer, engine: Engine) -> None:
        self.client = http(server)
        self.cm = self.client.stream("POST", "/v1/completions", json={**LONG, "stream": True})
        self.engine = engine

    def __enter__(self) -> "Running":
        response = self.cm.__enter__()
        assert response.status_code == 200  # headers come with the first token: it is running
        return self

    def __exit__(self, *exc: object) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def test_api_keys(server: BackgroundServer, engine: Engine) -> None:
    with http(server, key=None) as anon, http(server, key="wrong") as wrong:
        assert anon.get("/health").status_code == 200  # the one open endpoint
        for c in (anon, wrong):
            for method, path in [
                ("GET", "/v1/models"),
                ("POST", "/v1/chat/completions"),
                ("GET", "/metrics"),
                ("POST", "/generate"),
                ("POST", "/flush_cache"),
                ("GET", "/get_model_info"),
            ]:
                r = c.request(method, path, json={})
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["WWW-Authenticate"] == "Bearer"
    model = engine.model_info()["model_name"]
    for key in KEYS:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert sdk.models.list().data[0].id == model
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_each_key_is_its_own_cache_namespace(server: BackgroundServer) -> None:
    body = {
        "text": "Hello, world! How are you today? I'm fine, thanks.",
        "sampling_params": {"max_new_tokens": 1},
        "cache_salt": "shared-salt",
    }

    def cached(key: str) -> int:
        with http(server, key) as c:
            return c.post("/generate", json=body).json()["meta_info"]["cached_tokens"]

    assert cached(KEYS[0]) == 0
    assert cached(KEYS[0]) > 0
    assert cached(KEYS[1]) == 0  # same text, same cache_salt, another key: nothing shared


def test_full_queue_gets_429(server: BackgroundServer, engine: Engine) -> None:
    wait_idle(engine)
    short = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    with http(server) as c, ThreadPoolExecutor(2) as pool:
        with Running(server, engine):
            queued = [pool.submit(c.post, "/v1/completions", json=short) for _ in range(2)]
            wait_for(engine, "num_waiting", 2)
            r = c.post("/v1/completions", json=short)
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"].isdigit()
            assert r.json()["error"]["code"] == "queue_full"
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            assert r.status_code == 429
        # the long request was aborted by its disconnect; the queued ones then ran
        assert [f.result().status_code for f in queued] == [200, 200]
    wait_idle(engine)
    engine.check_invariants()


def test_queue_full_error_maps_to_429() -> None:
    """An engine built with max_queued_requests refuses by itself; the server turns that into 429 as well."""
    with pytest.raises(ApiError) as exc, engine_errors("prompt"):
        raise QueueFullError("3 requests are already waiting")
    assert exc.value.status == 429 and "Retry-After" in exc.value.headers


def test_abort_while_queued_frees_everything(server: BackgroundServer, engine: Engine) -> None:
    wait_idle(engine)
    with Running(server, engine):
        # a non-streaming and a streaming request wait behind the running one; their clients give up
        gave_up = threading.Barrier(3)

        def leave(body: dict) -> None:
            with http(server, timeout=0.1) as c:  # well before the running request (450 tokens) can end
                try:
                    if body.get("stream"):
                        with c.stream("POST", "/v1/completions", json=body) as s:
                            s.read()
                    else:
                        c.post("/v1/completions", json=body)
                except httpx.ReadTimeout:
                    pass
                else:
                    raise AssertionError("a queued request was answered while the only slot was busy")
            gave_up.wait()

        threads = [threading.Thread(target=leave, args=({**LONG, "stream": s},)) for s in (False, True)]
        for t in threads:
            t.start()
        gave_up.wait(timeout=30)
        for t in threads:
            t.join()
        wait_for(engine, "num_waiting", 0)  # both were dropped from the queue while the long one still runs
        assert engine.metrics()["num_running"] == 1
    wait_idle(engine)
    engine.check_invariants()


def test_prompt_too_long_for_the_pool(server: BackgroundServer, engine: Engine) -> None:
    prompt = " ".join(["fox"] * 600)  # fits the 1024-token context, not the 512-token pool
    assert POOL_TOKENS < len(engine.encode(prompt)) < engine.context_length
    with http(server) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "pool" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        ok = c.post("/v1/completions", json={"prompt": "fox", "max_tokens": 2})
        assert ok.status_code == 200
    engine.check_invariants()


def test_dead_engine_is_unhealthy_and_answers_503(tiny_model_dir: Path) -> None:
    eng = Engine(model=tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=256)
    try:
        with BackgroundServer(build_app(eng)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            eng.shutdown()
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        eng.shutdown()
