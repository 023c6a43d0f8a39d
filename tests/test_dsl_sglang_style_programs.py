"""The programs that tests/test_sglang_real_client.py runs under SGLang's own client, run unchanged under
frontend_dsl (`import frontend_dsl as sgl`) against the same kind of server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import frontend_dsl
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from server_fixtures import engine, server  # noqa: F401  (fixtures)
from sglang_style_programs import PROGRAMS, run_all


@pytest.fixture(scope="module")
def results(server: BackgroundServer) -> Iterator[dict[str, str]]:  # noqa: F811
    try:
        yield run_all(frontend_dsl, server.url)
    finally:
        frontend_dsl.set_default_backend(None)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_under_frontend_dsl(results: dict[str, str], name: str) -> None:
    assert results[name] == "ok", results[name]


@pytest.mark.parametrize("name", ["stream_text", "stream_logprobs"])
def test_streaming_programs_against_an_incremental_server(engine: Engine, name: str) -> None:  # noqa: F811
    """RuntimeEndpoint follows what /server_info says the server streams: deltas here, the text so far by default."""
    with BackgroundServer(build_app(engine, incremental_streaming_output=True)) as srv:
        backend = frontend_dsl.RuntimeEndpoint(srv.url)
        assert backend.incremental
        frontend_dsl.set_default_backend(backend)
        try:
            PROGRAMS[name](frontend_dsl)
        finally:
            frontend_dsl.set_default_backend(None)
