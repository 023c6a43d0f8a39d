"""The router over HTTP in front of fake workers (small starlette apps on 127.0.0.1): where requests go, streaming
through, retries, a worker dying mid-stream, health checks, run-time removal and addition, summed metrics."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from radixserve.router.app import build_router_app
from radixserve.router.health import Upkeep
from radixserve.router.policy import CacheAwareConfig
from radixserve.router.proxy import WORKER_HEADER
from radixserve.server.background import BackgroundServer

EVENTS = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


@dataclass
class Fake:
    """What a fake worker answers; tests change it between requests."""

    name: str
    mode: str = "ok"  # ok | status | die_mid_stream
    status: int = 503
    healthy: bool = True
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seen: list[dict] = field(default_factory=list)
    admin_calls: list[tuple[str, bytes]] = field(default_factory=list)  # (path, body) of /flush_cache, /abort_request


def fake_app(fake: Fake) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        fake.seen.append(body)
        if fake.mode == "status":
            return JSONResponse({"error": {"message": "no", "type": "x"}}, status_code=fake.status)
        if body.get("stream"):

            async def events():
                yield EVENTS[0]
                await asyncio.sleep(0.05)  # the first event reaches the client before the failure
                if fake.mode == "die_mid_stream":
                    raise RuntimeError("worker crashed")  # uvicorn drops the connection mid-body
                for e in EVENTS[1:]:
                    yield e

            return StreamingResponse(events(), media_type="text/event-stream")
        if fake.mode == "die_mid_stream":  # a non-streamed answer cut off after its first bytes

            async def partial():
                yield b'{"id": "cut'
                raise RuntimeError("worker crashed")

            return StreamingResponse(partial(), media_type="application/json")
        return JSONResponse({"worker": fake.name, "usage": {"prompt_tokens": 3}})

    async def health(request: Request) -> Response:
        return Response(status_code=200 if fake.healthy else 503)

    async def admin(request: Request) -> Response:
        fake.admin_calls.append((request.url.path, await request.body()))
        return Response(status_code=200 if fake.mode == "ok" else fake.status)

    async def metrics(request: Request) -> Response:
        text = (
            "# HELP radixserve_prompt_tokens_total prompt tokens\n# TYPE radixserve_prompt_tokens_total counter\n"
            f"radixserve_prompt_tokens_total {fake.prompt_tokens}\n"
            "# HELP radixserve_cached_tokens_total cached\n# TYPE radixserve_cached_tokens_total counter\n"
            f"radixserve_cached_tokens_total {fake.cached_tokens}\n"
            "# HELP radixserve_hit_rate hit rate\n# TYPE radixserve_hit_rate gauge\n"
            f"radixserve_hit_rate {fake.cached_tokens / fake.prompt_tokens if fake.prompt_tokens else 0}\n"
        )
        return Response(text, media_type="text/plain")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": fake.name}]})),
            Route("/server_info", lambda r: JSONResponse({"worker": fake.name})),
            Route("/flush_cache", admin, methods=["POST"]),
            Route("/abort_request", admin, methods=["POST"]),
            Route("/get_server_info", lambda r: JSONResponse({"worker": fake.name})),
        ]
    )


@pytest.fixture
def fakes() -> Iterator[tuple[list[Fake], list[str]]]:
    fs = [Fake("a"), Fake("b"), Fake("c")]
    with (
        BackgroundServer(fake_app(fs[0])) as a,
        BackgroundServer(fake_app(fs[1])) as b,
        BackgroundServer(fake_app(fs[2])) as c,
    ):
        yield fs, [a.url, b.url, c.url]


@pytest.fixture
def make_router() -> Iterator:
    apps, servers = [], []

    def make(urls: list[str], **kw) -> tuple[httpx.Client, object]:
        kw.setdefault("cache", CacheAwareConfig(cache_threshold=0.5))
        app = build_router_app(urls, start_upkeep=False, **kw)
        srv = BackgroundServer(app).__enter__()
        apps.append(app)
        servers.append(srv)
        return httpx.Client(base_url=srv.url, timeout=30), app.state.router

    yield make
    for srv in servers:
        srv.__exit__(None, None, None)
    for app in apps:
        app.state.close()


def chat(*turns: str, stream: bool = False) -> dict:
    msgs = [{"role": "system", "content": "You are a fake."}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs, "stream": stream}


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}"


def test_conversations_stay_on_their_worker(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:2])
    first = {}
    for conv in ("the first conversation about caches", "a second, unrelated conversation"):
        r = http.post("/v1/chat/completions", json=chat(conv))
        assert r.status_code == 200
        first[conv] = r.headers[WORKER_HEADER]
    assert set(first.values()) == set(urls[:2])  # a new prefix goes to the emptier tree: one conversation each
    for turn in range(3):
        for conv, home in first.items():
            r = http.post("/v1/chat/completions", json=chat(conv, f"answer {turn}", f"question {turn}"))
            assert r.headers[WORKER_HEADER] == home and r.json()["worker"] in ("a", "b")
    assert len(fs[0].seen) == len(fs[1].seen) == 4
    assert sum(n for (_, why), n in router.decisions.items() if why == "cache_hit") == 6


def test_round_robin_alternates(fakes, make_router) -> None:
    fs, urls = fakes
    http, _ = make_router(urls[:2], policy="round_robin")
    got = [http.post("/v1/chat/completions", json=chat("same conversation")).headers[WORKER_HEADER] for _ in range(4)]
    assert got == [urls[0], urls[1], urls[0], urls[1]]


def test_stream_passes_through_unchanged(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:1])
    with http.stream("POST", "/v1/chat/completions", json=chat("hi", stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = b"".join(r.iter_bytes())
    assert body == b"".join(EVENTS)
    assert router.pool.all()[0].load == 0


def test_worker_death_mid_stream_ends_the_stream_with_an_error(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:2])
    r = http.post("/v1/chat/completions", json=chat("conversation that will break"))
    home = r.headers[WORKER_HEADER]
    fs[urls.index(home)].mode = "die_mid_stream"
    with http.stream(
        "POST", "/v1/chat/completions", json=chat("conversation that will break", "a", "b", stream=True)
    ) as r:
        assert r.headers[WORKER_HEADER] == home
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0] == 'data: {"n": 0}' and events[-1] == "data: [DONE]"
    assert json.loads(events[1][len("data: ") :])["error"]["code"] == "worker_failed"
    assert len(events) == 3  # no retry once bytes were streamed: the worker got the request once
    dead = next(w for w in router.pool.all() if w.url == home)
    assert not dead.healthy and dead.load == 0 and router.worker_failures[home] == 1
    r = http.post("/v1/chat/completions", json=chat("conversation that will break", "a", "b", "c", "d"))
    assert r.status_code == 200 and r.headers[WORKER_HEADER] != home  # out of rotation until a health check passes


def test_non_streamed_answer_cut_off_is_retried_elsewhere(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:2])
    home = http.post("/v1/chat/completions", json=chat("cut me off")).headers[WORKER_HEADER]
    fs[urls.index(home)].mode = "die_mid_stream"
    r = http.post("/v1/chat/completions", json=chat("cut me off", "x", "y"))
    assert r.status_code == 200 and r.headers[WORKER_HEADER] != home and router.retries == 1
    assert all(w.load == 0 for w in router.pool.all())


def test_refused_and_503_workers_are_retried_but_client_errors_are_not(fakes, make_router) -> None:
    fs, urls = fakes
    dead = dead_url()
    http, router = make_router([dead, urls[0], urls[1]], policy="round_robin")
    r = http.post("/v1/chat/completions", json=chat("q"))  # round robin starts at the dead worker
    assert r.status_code == 200 and r.headers[WORKER_HEADER] in urls[:2] and router.retries == 1
    assert [w.healthy for w in router.pool.all()] == [False, True, True]
    fs[0].seen.clear(), fs[1].seen.clear()
    fs[0].mode = "status"  # 503: draining or broken -> try the other, and take it out of rotation
    for _ in range(2):  # whichever of the two round robin picks first, both answers come from b
        r = http.post("/v1/chat/completions", json=chat("q", stream=True))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == urls[1]
    assert len(fs[0].seen) == 1 and not router.pool.all()[1].healthy
    fs[1].mode, fs[1].status = "status", 400
    r = http.post("/v1/chat/completions", json=chat("q"))
    assert r.status_code == 400 and len(fs[1].seen) == 3  # the same request would fail anywhere: passed through
    fs[1].status = 503
    r = http.post("/v1/chat/completions", json=chat("q"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    assert http.get("/health").status_code == 503


def test_health_checks_take_workers_out_and_back(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:2])
    home = http.post("/v1/chat/completions", json=chat("health conversation")).headers[WORKER_HEADER]
    fake = fs[urls.index(home)]
    worker = next(w for w in router.pool.all() if w.url == home)
    upkeep = Upkeep(router)  # not started: the test runs the checks
    fake.healthy = False
    upkeep.check_all()
    assert worker.healthy  # one failure is not enough (failure_threshold 2)
    upkeep.check_all()
    assert not worker.healthy
    r = http.post("/v1/chat/completions", json=chat("health conversation", "a", "b"))
    assert r.headers[WORKER_HEADER] != home
    fake.healthy = True
    upkeep.check_all()
    assert worker.healthy and router.policy.tree.size(home) == 0  # back, with its tree forgotten
    upkeep.stop()


def test_workers_can_be_listed_removed_and_added(fakes, make_router) -> None:
    fs, urls = fakes
    http, router = make_router(urls[:2], admin_key="admin")
    homes = {
        http.post("/v1/chat/completions", json=chat(f"conversation {i} " * 4)).headers[WORKER_HEADER] for i in range(2)
    }
    assert homes == set(urls[:2])
    listed = http.get("/workers").json()
    assert listed["policy"] == "cache_aware" and [w["url"] for w in listed["workers"]] == urls[:2]
    assert all(w["tree_chars"] > 0 and w["healthy"] for w in listed["workers"])
    assert http.delete("/workers", params={"url": urls[0]}).status_code == 401  # the admin key guards changes
    auth = {"authorization": "Bearer admin"}
    assert http.delete("/workers", params={"url": urls[0]}, headers=auth).json()["removed"]["url"] == urls[0]
    assert http.delete("/workers", params={"url": urls[0]}, headers=auth).status_code == 404
    assert router.policy.tree.size(urls[0]) == 0
    for i in range(2):  # both conversations now land on the remaining worker
        r = http.post("/v1/chat/completions", json=chat(f"conversation {i} " * 4, "a", "b"))
        assert r.headers[WORKER_HEADER] == urls[1]
    added = http.post("/workers", json={"url": urls[2]}, headers=auth).json()
    assert added["added"] and added["worker"]["healthy"]
    assert http.post("/workers", json={"url": dead_url()}, headers=auth).json()["worker"]["healthy"] is False
    # it shares only the system prompt (well under half its text) with the others: the smallest tree, the new worker
    r = http.post("/v1/chat/completions", json=chat("a brand new conversation, about something else entirely"))
    assert r.headers[WORKER_HEADER] == urls[2]
    assert http.post("/workers", json={"nope": 1}, headers=auth).status_code == 400


def test_metrics_are_summed_over_workers(fakes, make_router) -> None:
    fs, urls = fakes
    fs[0].prompt_tokens, fs[0].cached_tokens = 10, 5
    fs[1].prompt_tokens, fs[1].cached_tokens = 30, 5
    http, _ = make_router(urls[:2] + [dead_url()])  # an unreachable worker is left out of the sums
    http.post("/v1/chat/completions", json=chat("count me"))
    samples = [s for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples]
    total = {s.name: s.value for s in samples if not s.labels}
    assert total["radixserve_prompt_tokens_total"] == 40 and total["radixserve_cached_tokens_total"] == 10
    assert total["radixserve_hit_rate"] == pytest.approx(0.25)  # recomputed, not 0.5 + 1/6
    per_worker = {
        s.labels["worker"]: s.value
        for s in samples
        if s.name == "radixserve_prompt_tokens_total" and "worker" in s.labels
    }
    assert per_worker == {urls[0]: 10, urls[1]: 30}
    routed = [s for s in samples if s.name == "radixserve_router_requests_total"]
    assert sum(s.value for s in routed) == 1 and routed[0].labels["reason"] == "smallest_tree"
    assert http.get("/v1/models").json()["data"][0]["id"] in ("a", "b")
    for path in ("/server_info", "/get_server_info"):  # SGLang's clients ask the router as they would a server
        assert http.get(path).json()["worker"] in ("a", "b")


def test_route_command_in_its_own_process(fakes) -> None:
    """`radixserve route` as deployed: a separate process in front of workers given by URL (the multi-machine
    layout, with every host on 127.0.0.1)."""
    fs, urls = fakes
    port = int(dead_url().rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "route",
            "--port",
            str(port),
            "--worker",
            urls[0],
            "--worker",
            urls[1].removeprefix("http://"),
            "--health-interval",
            "0.2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router did not come up"
            time.sleep(0.1)
        homes = {
            httpx.post(base + "/v1/chat/completions", json=chat(f"{word} " * 20), timeout=30).headers[WORKER_HEADER]
            for word in ("alpha", "omega")
        }
        assert homes == set(urls[:2])
        fs[0].healthy = False  # the router's own health thread notices (every 0.2 s, two failures)
        deadline = time.monotonic() + 30
        while any(w["healthy"] for w in httpx.get(base + "/workers").json()["workers"] if w["url"] == urls[0]):
            assert time.monotonic() < deadline, "the health checks did not take the worker out"
            time.sleep(0.1)
        assert (
            httpx.post(base + "/v1/chat/completions", json=chat("alpha " * 20, "a", "b"), timeout=30).headers[
                WORKER_HEADER
            ]
            == urls[1]
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_flush_and_abort_reach_every_worker(fakes, make_router) -> None:
    fs, urls = fakes
    http, _ = make_router(urls)
    assert http.post("/abort_request", json={"rid": "job-7"}).status_code == 200
    assert http.post("/flush_cache").json()["success"] is True
    for f in fs:  # a request may run on any worker: each is asked, with the caller's body
        assert f.admin_calls == [("/abort_request", b'{"rid":"job-7"}'), ("/flush_cache", b"")]
    fs[1].mode = "status"
    r = http.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 502 and r.json()["workers"][urls[1]] == 503
