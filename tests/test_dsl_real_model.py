"""Where meaning matters, the default model (Qwen2.5-Coder-0.5B-Instruct): SGLang's tool-use program picks the
calculator for arithmetic, the likelihood selection methods pick the right capital, and the OpenAI backend's chat model and
the in-process Runtime write the same greedy answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dsl_server import Server
from real_model import real_engine, real_model_dir  # noqa: F401  (fixtures)

import frontend_dsl as sgl
from radixserve.server.app import build_app

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(real_engine: Any) -> Iterator[Server]:
    s = Server(build_app(real_engine))
    yield s
    s.stop()


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "


@sgl.function
def capital(s, method):
    s += sgl.user("What is the capital of France? Answer with the city only.")
    s += sgl.assistant(sgl.select("city", choices=["Berlin", "Paris", "Madrid", "Rome"], choices_method=method))


@sgl.function
def ask(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12))


def test_tool_use_picks_the_calculator_for_arithmetic(real_engine: Any) -> None:
    state = tool_use.run(question="What is 39 + 3?", backend=sgl.Runtime(engine=real_engine))
    assert state["tool"] == "calculator"
    scores = state.get_meta_info("tool")["normalized_prompt_logprobs"]
    assert scores[0] > scores[1]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection])
def test_selection_methods_know_the_capital(real_engine: Any, server: Server, method: Any) -> None:
    for backend in (sgl.Runtime(engine=real_engine), sgl.RuntimeEndpoint(server.url)):
        assert capital.run(method=method, backend=backend)["city"] == "Paris"


def test_unconditional_normalization_divides_out_the_choices_prior(real_engine: Any, server: Server) -> None:
    # It favours the choice the prompt makes most MORE likely than it is on its own, which is not always the most
    # likely one ("Paris" is likely anyway); both backends must score it the same.
    states = [
        capital.run(method=sgl.unconditional_likelihood_normalized, backend=b)
        for b in (sgl.Runtime(engine=real_engine), sgl.RuntimeEndpoint(server.url))
    ]
    metas = [st.get_meta_info("city") for st in states]
    assert states[0]["city"] == states[1]["city"]
    assert metas[0]["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        metas[1]["normalized_unconditional_prompt_logprobs"], abs=1e-3
    )
    scores = metas[0]["normalized_unconditional_prompt_logprobs"]
    assert states[0]["city"] == ["Berlin", "Paris", "Madrid", "Rome"][scores.index(max(scores))]


def test_openai_chat_model_answers_as_the_runtime_does(real_engine: Any, server: Server) -> None:
    oa = sgl.OpenAI(real_engine.model_info()["model_name"], base_url=server.url + "/v1")
    remote = ask.run(question="What is the capital of France?", backend=oa, temperature=0)
    local = ask.run(question="What is the capital of France?", backend=sgl.Runtime(engine=real_engine), temperature=0)
    assert "Paris" in remote["answer"] and remote["answer"] == local["answer"]


async def test_text_async_iter_streams_the_answer(real_engine: Any) -> None:
    state = ask.run(
        question="Name a primary color.", backend=sgl.Runtime(engine=real_engine), stream=True, temperature=0
    )
    pieces = [out async for out in state.text_async_iter(var_name="answer")]
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]
