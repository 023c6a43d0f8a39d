"""frontend_dsl over HTTP: RuntimeEndpoint against the radixserve app (uvicorn in a thread) gives what Runtime gives."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsl_server import Server

import frontend_dsl as sgl
from radixserve.server.app import build_app

GREEDY = {"temperature": 0}


@pytest.fixture
def engine(tiny_model_dir: Path, make_engine) -> Any:
    return make_engine(tiny_model_dir, page_size=16, max_total_tokens=16384)


@pytest.fixture
def server(engine: Any) -> Iterator[Server]:
    s = Server(build_app(engine))
    yield s
    s.stop()


@sgl.function
def chat(s, question):
    s += sgl.system("You answer in one word.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    s += sgl.user("Is that your final answer?")
    s += sgl.assistant(sgl.select("final", choices=["Yes", "No", "Let me think again"]))


@sgl.function
def branches(s, topic):
    s += "Three views on " + topic + ".\n"
    forks = s.fork(3)
    forks += lambda i: f"View {i + 1}:" + sgl.gen("view", max_tokens=6, stop="\n")
    forks.join()
    for i, view in enumerate(s["view"]):
        s += f"({i + 1}){view}\n"
    s += "Summary:" + sgl.gen("summary", max_tokens=6)


def snapshot(state: sgl.ProgramState) -> dict[str, Any]:
    meta = state.get_meta_info("final") if "final" in state else None
    return {
        "text": state.text(),
        "messages": state.messages(),
        "vars": {k: state[k] for k in ("answer", "final", "view", "summary") if k in state},
        "select_scores": meta["normalized_prompt_logprobs"] if meta else None,
    }


def _flat(result: list[Any]) -> list[dict[str, Any]]:
    """The snapshots of one backend's run, the batch's included."""
    return [x for item in result for x in (item if isinstance(item, list) else [item])]


def test_in_process_and_http_backends_give_identical_results(engine: Any, server: Server) -> None:
    local = sgl.Runtime(engine=engine)
    remote = sgl.RuntimeEndpoint(server.url)
    results = {}
    for name, backend in (("local", local), ("remote", remote)):
        results[name] = [
            snapshot(chat.run(question="What is a radix tree?", backend=backend, **GREEDY)),
            snapshot(branches.run(topic="caching", backend=backend, **GREEDY)),
            [
                snapshot(st)
                for st in chat.run_batch([{"question": f"q{i}"} for i in range(4)], backend=backend, **GREEDY)
            ],
        ]
    # Text, messages and variables are identical; the choice scores are float sums over the prompt's logprobs, and
    # with speculation on (`auto` drafts only in steps it measures to pay, so the two runs verify in different
    # steps) a verify step's batched matmul rounds differently in the last float32 bits (DESIGN rule 6).
    scores = {name: [st.pop("select_scores") for st in _flat(r)] for name, r in results.items()}
    assert results["local"] == results["remote"]
    for a, b in zip(scores["local"], scores["remote"], strict=True):
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-5)
    assert results["remote"][0]["messages"][-1]["content"] in ("Yes", "No", "Let me think again")


def test_streaming_over_http_yields_text_as_produced(engine: Any, server: Server) -> None:
    remote = sgl.RuntimeEndpoint(server.url)
    streamed = branches.run(topic="pages", backend=remote, stream=True, **GREEDY)
    pieces = list(streamed.text_iter())
    assert "".join(pieces) == streamed.text()
    assert len(pieces) > 5
    assert streamed.text() == branches.run(topic="pages", backend=sgl.Runtime(engine=engine), **GREEDY).text()


def test_cache_stats_over_http_are_the_engines(engine: Any, server: Server) -> None:
    remote = sgl.RuntimeEndpoint(server.url)
    branches.run(topic="trees", backend=remote, **GREEDY)
    local_stats = engine.cache_stats()
    remote_stats = remote.cache_stats()
    assert remote_stats["hit_tokens"] == local_stats["hit_tokens"] > 0
    assert remote_stats["hit_rate"] == pytest.approx(local_stats["hit_rate"])


def test_a_rejected_request_is_a_clear_error(server: Server) -> None:
    @sgl.function
    def too_long(s):
        s += "Hi" + sgl.gen("x", max_tokens=10**6)

    with pytest.raises(sgl.ProgramError) as info:
        too_long.run(backend=sgl.RuntimeEndpoint(server.url))
    cause = info.value.cause
    assert isinstance(cause, sgl.BackendError) and cause.status == 400
    assert "context length" in str(cause)


def test_api_key_is_sent(engine: Any) -> None:
    s = Server(build_app(engine, api_key="sesame"))
    try:
        with pytest.raises(sgl.BackendError) as info:
            sgl.RuntimeEndpoint(s.url)
        assert info.value.status == 401
        state = chat.run(question="hi", backend=sgl.RuntimeEndpoint(s.url, api_key="sesame"), **GREEDY)
        assert state["final"] in ("Yes", "No", "Let me think again")
    finally:
        s.stop()


def test_a_server_that_is_down_fails_fast() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(sgl.BackendError, match="cannot reach"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5


def test_a_server_that_never_answers_times_out() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections (the kernel does) but never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(sgl.BackendError, match="no answer within"):
            sgl.RuntimeEndpoint(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        listener.close()
