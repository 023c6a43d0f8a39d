"""Fault isolation (issue 12) on the agent APIs of issue 36, /v1/responses and /v1/messages: the sampling values that
once killed the loop answer 4xx in each API's own error shape naming the field, streamed or not; an internal failure
is that request's 500 (or in-band error event) alone; the engine serves as before after each."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine_checks import wait_idle
from fault_fixtures import BAD_PARAMS, break_detokenizer_on_boom, serves_as_before
from fault_fixtures import engine, reference  # noqa: F401  (fixtures)
from test_fault_isolation_http import http  # noqa: F401  (fixture: a server with a queue limit)

# The sampling fields each API takes, as its clients name them.
RESPONSES_FIELDS = {"temperature": "temperature", "top_k": "top_k", "seed": "seed", "stop": "stop"}
MESSAGES_FIELDS = {"temperature": "temperature", "top_k": "top_k", "seed": "seed", "stop": "stop_sequences"}
CASES = [
    (path, {names[k]: v for k, v in params.items()}, names[field])
    for path, names in (("/v1/responses", RESPONSES_FIELDS), ("/v1/messages", MESSAGES_FIELDS))
    for params, field in BAD_PARAMS
    if set(params) <= set(names)
]
BODIES = {
    "/v1/responses": {"model": "default", "input": "hi", "max_output_tokens": 4, "temperature": 0},
    "/v1/messages": {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,  # sampled, a first token could be EOS, which no detokenizer step sees (no fault)
    },
}


def _named(path: str, body: dict[str, Any], field: str) -> bool:
    """Whether the error body is in the API's own shape and names the field."""
    if path == "/v1/messages":
        return body["type"] == "error" and field in body["error"]["message"]
    return body["error"]["param"] == field


@pytest.mark.parametrize("path,params,field", CASES, ids=[f"{p}-{f}" for p, _, f in CASES])
def test_bad_sampling_values_are_4xx_in_the_apis_shape(
    http: httpx.Client, engine: Any, reference: list[int], path: str, params: dict[str, Any], field: str
) -> None:
    for stream in (False, True):
        r = http.post(path, json={**BODIES[path], **params, "stream": stream})
        assert 400 <= r.status_code < 500, r.text
        assert _named(path, r.json(), field), r.text
    assert http.post(path, json=BODIES[path]).status_code == 200
    serves_as_before(engine, reference)


@pytest.mark.parametrize("path,stop", [("/v1/responses", "stop"), ("/v1/messages", "stop_sequences")])
def test_an_internal_failure_is_that_requests_alone(
    http: httpx.Client, engine: Any, reference: list[int], monkeypatch: pytest.MonkeyPatch, path: str, stop: str
) -> None:
    break_detokenizer_on_boom(monkeypatch, "secret text of another tenant")
    r = http.post(path, json={**BODIES[path], stop: ["BOOM"]})
    assert r.status_code == 500 and "secret" not in r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    else:
        assert r.json()["error"]["type"] == "internal_error"
    with http.stream("POST", path, json={**BODIES[path], stop: ["BOOM"], "stream": True}) as s:
        text = "".join(s.iter_text())  # the stream's status line went out before the failure: the error is in-band
    assert s.status_code in (200, 500) and "error" in text and "secret" not in text
    monkeypatch.undo()
    assert http.post(path, json=BODIES[path]).status_code == 200
    serves_as_before(engine, reference)


LONG = {
    "/v1/responses": {"model": "default", "input": "Tell a long story.", "max_output_tokens": 400, "temperature": 0},
    "/v1/messages": {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 400,
        "temperature": 0,
    },
}


@pytest.mark.parametrize("path", list(LONG))
def test_a_client_that_leaves_after_the_first_event_frees_its_request(
    http: httpx.Client, engine: Any, path: str
) -> None:
    whole = http.post(path, json=LONG[path]).json()
    full = whole["usage"]["output_tokens"]
    assert full > 100, whole["usage"]  # greedy on the fixture model: a long answer, so a cut-off one is shorter
    wait_idle(engine)
    before = engine.metrics()["generation_tokens_total"]
    with http.stream("POST", path, json={**LONG[path], "stream": True}) as s:
        assert s.status_code == 200
        assert next(s.iter_lines()).startswith("event: ")  # the first event, before any token is read
    wait_idle(engine)
    assert engine.metrics()["generation_tokens_total"] - before < full
    engine.check_invariants()
