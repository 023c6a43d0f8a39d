"""One request must never harm the others, through HTTP (issue 12): 400s naming the field, malformed bodies, huge
prompts, internal errors answered 500 for their request alone, slow clients cut off. (schemathesis over the whole
API: tests/test_openapi.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fault_fixtures import BAD_PARAMS, GREEDY, PROMPT, break_detokenizer_on_boom
from fault_fixtures import engine, reference  # noqa: F401  (fixtures)
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer


@pytest.fixture(scope="module")
def http(engine: Any) -> Iterator[httpx.Client]:
    with (
        BackgroundServer(build_app(engine, max_queued_requests=4)) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as client,
    ):
        yield client


@pytest.mark.parametrize("params,field", BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_generate_answers_400_naming_the_field(
    http: httpx.Client, engine: Any, reference: list[int], params: dict[str, Any], field: str
) -> None:
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    ok = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert ok.status_code == 200 and ok.json()["output_ids"] == reference
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        (b'{"text": "\xff\xfe"}', None),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"input_ids": [[1, 2], 3]}', "input_ids"),
        (b'{"text": "hi", "sampling_params": {"seed": 1.5}}', "seed"),
    ],
)
def test_malformed_bodies_are_400(http: httpx.Client, body: bytes, param: str | None) -> None:
    r = http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_huge_prompt_is_refused_before_tokenizing(http: httpx.Client, engine: Any) -> None:
    start = time.perf_counter()
    r = http.post("/generate", json={"text": "fox " * 1_000_000, "sampling_params": GREEDY})  # 4 MB
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large", r.text
    assert time.perf_counter() - start < 30  # generous: the point is that it is not tokenized (see RESULTS.md)


def test_internal_errors_answer_500_naming_the_request(
    http: httpx.Client, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_detokenizer_on_boom(monkeypatch, "secret text of another tenant")
    r = http.post(
        "/generate", json={"input_ids": PROMPT, "rid": "req-42", "sampling_params": {**GREEDY, "stop": ["BOOM"]}}
    )
    assert r.status_code == 500
    err = r.json()["error"]
    assert "req-42" in err["message"] and "secret" not in r.text
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    failed = [line for line in metrics.splitlines() if line.startswith("radixserve_failed_requests_total ")]
    assert failed and float(failed[0].split()[1]) >= 1


def test_slow_headers_and_stalled_bodies_are_cut_off(engine: Any) -> None:
    import socket

    from radixserve.server.timeouts import header_timeout_protocol

    app = build_app(engine, body_timeout_s=0.5)
    with BackgroundServer(app, http=header_timeout_protocol(0.5)) as srv:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        slow.settimeout(5)
        start = time.monotonic()
        assert slow.recv(100) == b""  # closed by the server
        assert time.monotonic() - start < 4
        slow.close()
        stalled = socket.create_connection(("127.0.0.1", srv.port))
        stalled.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text":'
        )  # the rest of the body never comes
        stalled.settimeout(5)
        assert b" 408 " in stalled.recv(200).split(b"\r\n")[0] + b" "
        stalled.close()
        with httpx.Client(base_url=srv.url, timeout=30) as c:  # and the server still serves
            assert c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).status_code == 200
