"""Tenants over HTTP: every endpoint x no key / user / admin; per-namespace flush; a rid reused by another tenant
(with a real disconnect) aborts nothing of the first; per-key quotas (429 + Retry-After, OpenAI-style body, counters
per key name in /metrics), on every route that runs the model and while other keys stream; request timeouts and
priorities as request fields."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine_checks import engine_left_at_rest, wait_idle
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.tenants import KeyRing, KeySources

KEYS = {
    "admin": "sk-admin-0001 name=ops role=admin",
    "alice": "sk-alice-0002 name=alice role=user",
    "bob": "sk-bob-0003 name=bob role=user",
    "solo": "sk-solo-0004 name=solo role=user max_concurrent=1 max_queued=0",
    "queue": "sk-queue-0005 name=queue role=user max_concurrent=1 max_queued=1",
    "tpm": "sk-tpm-0006 name=tpm role=user tokens_per_minute=40",
    "busy": "sk-busy-0007 name=busy role=user max_concurrent=1 max_queued=0",
    "tpm2": "sk-tpm2-0008 name=tpm2 role=user tokens_per_minute=40",
}
TEXT = "Hello, world! How are you today? I'm fine, thanks. And the fox?"
# Long enough to hold its slot through the tests below: the tiny model decodes ~1,500 tokens/s on a quiet 2-core CPU.
LONG = {
    "text": "The quick brown fox",
    "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0},
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    # Speculation off: LONG must hold its slot for a while, and accepted drafts would finish it in a few steps.
    with engine_left_at_rest(
        tiny_model_dir, dtype="float32", page_size=4, max_total_tokens=4096, max_running_requests=4, speculative="off"
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    keys = KeyRing(KeySources(cli=tuple(KEYS.values())))
    with BackgroundServer(build_app(engine, api_key=keys)) as srv:
        yield srv


def client(server: BackgroundServer, who: str | None, timeout: float = 60) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[who].split()[0]}"} if who else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


ENDPOINTS = {
    ("GET", "/health"): None,
    ("GET", "/v1/models"): None,
    ("POST", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ("POST", "/v1/completions"): {"prompt": "hi", "max_tokens": 2},
    ("POST", "/generate"): {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    ("POST", "/tokenize"): {"prompt": "hi"},
    ("POST", "/detokenize"): {"tokens": [1, 2]},
    ("POST", "/flush_cache"): None,
    ("POST", "/cache/pin"): {"text": TEXT},  # in the key's own namespace
    ("POST", "/cache/unpin"): {"text": TEXT},
    ("GET", "/get_model_info"): None,
    ("GET", "/server_info"): None,
    ("GET", "/get_server_info"): None,
    ("POST", "/abort_request"): {"rid": "nothing-running"},
    ("GET", "/metrics"): None,
    ("GET", "/openapi.json"): None,
    ("POST", "/v1/responses"): {"input": "hi", "max_output_tokens": 2},
    ("GET", "/v1/responses/{response_id}"): None,  # the response the key just stored
    ("DELETE", "/v1/responses/{response_id}"): None,
    ("POST", "/v1/messages"): {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ("POST", "/v1/messages/count_tokens"): {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
}


def check_view(path: str, who: str, r: httpx.Response) -> None:
    """What a user sees differs from what an admin sees on these endpoints."""
    admin = who == "admin"
    if path == "/flush_cache":
        assert ("flushed_pages" in r.json()) != admin, r.text
    elif path in ("/get_model_info", "/server_info", "/get_server_info"):
        assert ("model_path" in r.json()) == admin
    elif path == "/metrics":
        assert ("radixserve_num_running " in r.text) == admin  # server-wide figures
        assert ('key="bob"' in r.text) == admin  # another tenant's counters
        assert f'radixserve_key_requests_total{{key="{who if who != "admin" else "ops"}"}}' in r.text
        assert "sk-" not in r.text  # names only, never keys


def test_every_endpoint_by_role(server: BackgroundServer, engine: Engine) -> None:
    routes = {
        (m, r.path) for r in server.server.config.app.routes for m in getattr(r, "methods", None) or () if m != "HEAD"
    }
    # The cache explorer's routes (/dashboard, /cache/tree, ...) show each key only its own namespaces: their
    # key x namespace table is tests/test_dashboard.py's.
    explorer = {(m, p) for m, p in routes if p == "/dashboard" or p.startswith("/cache/") and "pin" not in p}
    assert routes - {("GET", "/flush_cache")} - explorer == set(ENDPOINTS), "the table covers every endpoint"
    cached(server, "bob")  # another tenant with counters of its own
    for who in (None, "alice", "admin"):
        with client(server, who) as c:
            stored = "none"
            for (method, path), body in ENDPOINTS.items():
                wait_idle(engine)
                r = c.request(method, path.replace("{response_id}", stored), json=body)
                if who is None and path != "/health":
                    err = r.json()["error"]  # OpenAI's envelope has a code; Anthropic's (/v1/messages) a type
                    assert r.status_code == 401 and err["type"] == "authentication_error", (path, r.text)
                    assert err.get("code", "invalid_api_key") == "invalid_api_key", (path, r.text)
                    continue
                assert r.status_code == 200, (who, path, r.text)
                stored = r.json()["id"] if path == "/v1/responses" else stored
                if who is not None:
                    check_view(path, who, r)


def cached(server: BackgroundServer, who: str) -> int:
    with client(server, who) as c:
        r = c.post("/generate", json={"text": TEXT, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]


def test_user_flush_drops_only_its_own_namespace(server: BackgroundServer, engine: Engine) -> None:
    for who in ("alice", "bob", "alice", "bob"):
        cached(server, who)
    assert cached(server, "alice") > 0 and cached(server, "bob") > 0
    with client(server, "alice") as c:
        r = c.post("/flush_cache")
    assert r.status_code == 200 and r.json()["flushed_pages"] > 0
    engine.check_invariants()
    assert cached(server, "bob") > 0  # the other tenant's entries are intact (no flush-then-probe side channel)
    assert cached(server, "alice") == 0  # alice's are gone
    with client(server, "alice") as c:  # a user may not name another key
        r = c.post("/flush_cache", params={"key": "bob"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    assert cached(server, "alice") > 0 and cached(server, "bob") > 0
    with client(server, "admin") as c:  # the admin flushes one key's namespaces, then everything
        assert c.post("/flush_cache", params={"key": "nobody-by-that-name"}).status_code == 404
        assert c.post("/flush_cache", params={"key": "alice"}).json()["flushed_pages"] > 0
        assert cached(server, "alice") == 0 and cached(server, "bob") > 0
        wait_idle(engine)
        assert c.post("/flush_cache").json()["message"] == "cache flushed"
    assert cached(server, "bob") == 0


def test_a_rid_reused_by_another_tenant_aborts_nothing_of_the_first(server: BackgroundServer, engine: Engine) -> None:
    wait_idle(engine)
    body = {**LONG, "rid": "shared-id", "stream": True}
    with client(server, "alice") as alice:
        with alice.stream("POST", "/generate", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert '"id":"shared-id"' in first  # the client's rid is the label it sees
            # bob reuses the rid, then hangs up mid-request: his request is aborted, alice's must go on
            with client(server, "bob", timeout=0.5) as bob, pytest.raises(httpx.TimeoutException):
                bob.post("/generate", json={**LONG, "rid": "shared-id"})
            with client(server, "bob") as bob:  # nor can bob's /abort_request reach it, by rid or all at once
                assert bob.post("/abort_request", json={"rid": "shared-id"}).status_code == 200
                assert bob.post("/abort_request", json={"abort_all": True}).status_code == 200
            events = [line for line in lines if line.startswith("data: {")]
    import json

    last = json.loads(events[-1][len("data: ") :])
    assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] == LONG["sampling_params"]["max_new_tokens"]
    wait_idle(engine)
    engine.check_invariants()


def error_of(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == code and err["message"], err


class Streaming:
    """A long stream holding one of its key's concurrent slots until closed."""

    def __init__(self, server: BackgroundServer, who: str) -> None:
        self.client = client(server, who)
        self.cm = self.client.stream("POST", "/generate", json={**LONG, "stream": True})

    def __enter__(self) -> "Streaming":
        assert self.cm.__enter__().status_code == 200
        return self

    def __exit__(self, *exc: object) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def metric(server: BackgroundServer, line_start: str) -> float:
    with client(server, "admin") as c:
        text = c.get("/metrics").text
    found = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_max_concurrent_and_max_queued(server: BackgroundServer, engine: Engine) -> None:
    short = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    with Streaming(server, "solo"), client(server, "solo") as solo, client(server, "alice") as alice:
        error_of(solo.post("/generate", json=short), "too_many_concurrent_requests")
        assert alice.post("/generate", json=short).status_code == 200  # another key is not held back
    assert metric(server, 'radixserve_key_rejected_total{key="solo",quota="max_queued"}') == 1
    with ThreadPoolExecutor(1) as pool, client(server, "queue") as c:
        with Streaming(server, "queue"):
            waiting = pool.submit(c.post, "/generate", json=short)
            deadline = time.monotonic() + 10
            while metric(server, 'radixserve_key_queued_requests{key="queue"}') != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert not waiting.done()
            error_of(c.post("/generate", json=short), "too_many_concurrent_requests")  # the queue of 1 is full
        assert waiting.result().status_code == 200  # ran once the stream's slot was free
    wait_idle(engine)


def test_tokens_per_minute(server: BackgroundServer) -> None:
    with client(server, "tpm") as c:
        r = c.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 30, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] >= 40
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        error_of(r, "tokens_per_minute_exceeded")
        assert int(r.headers["Retry-After"]) <= 60
    assert metric(server, 'radixserve_key_tokens_total{key="tpm"}') >= 40
    assert metric(server, 'radixserve_key_rejected_total{key="tpm",quota="tokens_per_minute"}') == 1


# A request of `n` tokens for each route that runs the model.
GENERATING = {
    "/v1/chat/completions": lambda n: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
    "/v1/completions": lambda n: {"prompt": "hi", "max_tokens": n},
    "/generate": lambda n: {"text": "hi", "sampling_params": {"max_new_tokens": n}},
    "/v1/responses": lambda n: {"input": "hi", "max_output_tokens": n},
    "/v1/messages": lambda n: {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
}


def rate_limited(path: str, r: httpx.Response, code: str) -> None:
    if path.startswith("/v1/messages"):  # Anthropic's envelope has no code: the message names the quota
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit(), r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    else:
        error_of(r, code)


def test_quotas_hold_on_every_generation_route_under_load(server: BackgroundServer, engine: Engine) -> None:
    """While other keys stream on every route, a key at its concurrency limit is refused on each route that runs
    the model (the Responses and Messages routes included), and the others finish."""
    with ThreadPoolExecutor(len(GENERATING) * 2) as pool, Streaming(server, "busy"):
        load = [
            pool.submit(lambda p=path, b=body(40), w=who: client(server, w).post(p, json=b))
            for path, body in GENERATING.items()
            for who in ("alice", "bob")
        ]
        with client(server, "busy") as busy:
            for path, body in GENERATING.items():
                rate_limited(path, busy.post(path, json=body(2)), "too_many_concurrent_requests")
        assert all(f.result().status_code == 200 for f in load), [f.result().text for f in load]
    assert metric(server, 'radixserve_key_rejected_total{key="busy",quota="max_queued"}') == len(GENERATING)
    wait_idle(engine)


def test_tokens_per_minute_counts_every_route(server: BackgroundServer) -> None:
    """Tokens spent through /v1/messages count against the key's minute on the other routes, and back."""
    with client(server, "tpm2") as c:
        long_turn = {**GENERATING["/v1/messages"](2), "messages": [{"role": "user", "content": TEXT}]}
        r = c.post("/v1/messages", json=long_turn)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]  # Anthropic's input_tokens leave out the tokens read from or written to the cache
        spent = sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        assert spent + usage["output_tokens"] >= 40, r.text
        for path, body in GENERATING.items():
            rate_limited(path, c.post(path, json=body(2)), "tokens_per_minute_exceeded")
    assert metric(server, 'radixserve_key_tokens_total{key="tpm2"}') >= 40


def test_a_waiting_client_that_leaves_gives_up_its_place(server: BackgroundServer, engine: Engine) -> None:
    wait_idle(engine)
    with Streaming(server, "queue"):
        outcome: list = []

        def leave() -> None:
            with client(server, "queue", timeout=0.3) as c:
                try:
                    r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
                    outcome.append((r.status_code, r.text))
                except httpx.TimeoutException:
                    outcome.append("gave up")

        t = threading.Thread(target=leave)
        t.start()
        t.join()
        assert outcome == ["gave up"], outcome
        deadline = time.monotonic() + 10
        while metric(server, 'radixserve_key_queued_requests{key="queue"}') != 0:
            assert time.monotonic() < deadline, "the client left, its place in the key's queue stayed"
            time.sleep(0.05)
    wait_idle(engine)


def test_timeout_and_priority_fields(server: BackgroundServer, engine: Engine) -> None:
    with client(server, "alice") as c:
        r = c.post(
            "/generate",
            json={**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 900}, "timeout": 0.2},
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 5, "timeout": 30})
        assert r.status_code == 200
        for body, param in (
            ({"priority": "high"}, "priority"),
            ({"timeout": -1}, "timeout"),
            ({"timeout": "soon"}, "timeout"),
        ):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text
    wait_idle(engine)
    engine.check_invariants()
