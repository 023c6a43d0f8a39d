"""More clients than `--max-connections` at once (issue 33): those past the limit get a 503 at once, and the clients
already connected are served to the end; once they leave, new clients are served again. (uvicorn's
`limit_concurrency` counts the connection asking too: LIMIT - 1 others leave no room for it.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from server_fixtures import engine  # noqa: F401  (fixture)

LIMIT = 3
TOKENS = 600
STREAM = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}


def _sse_lines(r: httpx.Response) -> Iterator[str]:
    """The stream's lines split as SSE splits them, on "\n" alone: httpx's iter_lines also splits on \x85 and
    \u2028, which the sampled text may hold and JSON leaves unescaped."""
    pending = ""
    for text in r.iter_text():
        *done, pending = (pending + text).split("\n")
        yield from (line.rstrip("\r") for line in done)
    if pending:
        yield pending


def _stream(url: str, started: threading.Event, checked: threading.Event, out: list[Any]) -> None:
    """One client holding its connection until the refusals were checked: on a quiet machine the tiny model can
    finish all TOKENS before the checks run, and a client that read to the end and left would free its place."""
    with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/generate", json=STREAM) as r:
        lines = _sse_lines(r)
        events = [next(lines)]
        started.set()
        checked.wait(120)
        events += [line for line in lines if line.startswith("data:")]
    out.append((r.status_code, events))


def test_clients_past_max_connections_get_503_and_the_others_are_served(engine: Engine) -> None:  # noqa: F811
    with BackgroundServer(build_app(engine), limit_concurrency=LIMIT) as srv:
        results: list[Any] = []
        threads, checked = [], threading.Event()
        for _ in range(LIMIT - 1):
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(srv.url, started, checked, results))
            t.start()
            assert started.wait(120)
            threads.append(t)
        refused = [httpx.get(srv.url + "/health", timeout=30).status_code for _ in range(4)]
        checked.set()
        for t in threads:
            t.join(300)
        assert refused == [503] * 4
        assert len(results) == LIMIT - 1
        for status, events in results:
            last = json.loads(events[-2][5:])
            assert status == 200 and events[-1] == "data: [DONE]" and last["meta_info"]["completion_tokens"] == TOKENS
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
