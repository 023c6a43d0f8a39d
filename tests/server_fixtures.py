"""One tiny engine behind a live uvicorn on 127.0.0.1 (random port) per test module, with the real `openai` SDK
and an httpx client on it: the fixtures of tests/test_server.py and tests/test_server_native.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

PAGE = 4
MAX_BODY = 256 * 1024
GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fast fox."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(tiny_model_dir, dtype="float32", page_size=PAGE, max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine, max_body_bytes=MAX_BODY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(engine: Engine) -> str:
    return engine.model_info()["model_name"]


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parse `data:` lines; the last event must be [DONE]."""
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def page_floor(n: int) -> int:
    return n // PAGE * PAGE
