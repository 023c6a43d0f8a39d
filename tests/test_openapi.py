"""/openapi.json against the server (issue 33): every route of the app is described, the request schemas refuse
what the server refuses (an empty body, empty messages or prompt, token ids past the vocabulary), a 405 names the
methods in Allow, and schemathesis over the whole description finds no 5xx and no answer outside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
from starlette.routing import Route

from engine_checks import wait_idle
from radixserve import Engine
from radixserve.server.background import BackgroundServer
from server_fixtures import engine, server  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def doc(server: BackgroundServer) -> dict[str, Any]:
    return httpx.get(server.url + "/openapi.json").json()


def _valid(doc: dict[str, Any], component: str, body: Any) -> bool:
    schema = {"$ref": f"#/components/schemas/{component}", "components": doc["components"]}
    return jsonschema_rs.validator_for(schema).is_valid(body)


def test_every_route_is_described(server: BackgroundServer, doc: dict[str, Any]) -> None:
    routes = {
        (m.lower(), r.path)
        for r in server.server.config.app.routes
        if isinstance(r, Route)
        for m in r.methods or ()
        if m != "HEAD"
    }
    described = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == described
    assert "x-admin-only" in doc["paths"]["/metrics"]["get"] and "x-admin-only" in doc["paths"]["/flush_cache"]["post"]


def test_schemas_refuse_what_the_server_refuses(server: BackgroundServer, doc: dict[str, Any]) -> None:
    vocab = httpx.get(server.url + "/get_model_info").json()["vocab_size"]
    cases = [
        ("GenerateBody", "/generate", {}),
        ("GenerateBody", "/generate", {"text": "hi", "input_ids": [1]}),
        ("GenerateBody", "/generate", {"text": ""}),
        ("GenerateBody", "/generate", {"input_ids": []}),
        ("PinRequest", "/cache/pin", {}),
        ("PinRequest", "/cache/pin", {"input_ids": [vocab]}),
        ("ChatCompletionRequest", "/v1/chat/completions", {"messages": []}),
        ("CompletionRequest", "/v1/completions", {"prompt": ""}),
        ("DetokenizeRequest", "/detokenize", {"tokens": [vocab]}),
        ("DetokenizeRequest", "/detokenize", {"tokens": [-1]}),
    ]
    for component, path, body in cases:
        assert not _valid(doc, component, body), (component, body)
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 400, (path, body)
    for component, body in [
        ("GenerateBody", {"text": "hi", "input_ids": None}),
        ("PinRequest", {"input_ids": [vocab - 1]}),
        ("DetokenizeRequest", {"tokens": [0, vocab - 1]}),
        ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        assert _valid(doc, component, body), (component, body)


def test_405_names_the_allowed_methods(server: BackgroundServer) -> None:
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.delete(server.url + "/flush_cache")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}


@pytest.mark.slow
def test_schemathesis_finds_no_answer_outside_the_description(
    server: BackgroundServer, engine: Engine, tmp_path: Path
) -> None:
    """Every operation (the endless /cache/events stream left out), deterministic generation, a bounded number of
    examples: no 5xx, and every status, content type and error body as described. Two workers: the coverage phase's
    ~4,600 cases took 386 s one at a time on 2 cores, 58% of it schemathesis's own work while the server waited;
    240 s with two."""
    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    done = subprocess.run(
        [
            cli,
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            checks,
            "--exclude-path",
            "/cache/events",
            "--max-examples",
            "15",
            "--generation-deterministic",
            "--request-timeout",
            "60",
            "--max-failures",
            "10",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(engine)
    engine.check_invariants()
