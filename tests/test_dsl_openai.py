"""The OpenAI backend against radixserve's own /v1 routes (tiny model): a completion model gives what the native
backends give for plain-text programs (gen, stream, select scores), a chat model what they give for role programs,
and what the OpenAI API cannot express is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsl_server import Server

import frontend_dsl as sgl
from radixserve.server.app import build_app

GREEDY = {"temperature": 0}
PREFIX = "The quick brown fox jumps over the lazy dog. The answer is "
CHOICES = ["dog", "forest into the fox", "x", "radix tree"]


@pytest.fixture
def engine(tiny_model_dir: Path, make_engine) -> Any:
    return make_engine(tiny_model_dir, page_size=16, max_total_tokens=16384)


@pytest.fixture
def server(engine: Any) -> Iterator[Server]:
    s = Server(build_app(engine, api_key="sesame"))
    yield s
    s.stop()


def openai(engine: Any, server: Server, chat: bool) -> sgl.OpenAI:
    return sgl.OpenAI(
        engine.model_info()["model_name"], base_url=server.url + "/v1", api_key="sesame", is_chat_model=chat
    )


@sgl.function
def story(s, topic):
    s += "A story about " + topic + ":" + sgl.gen("start", max_tokens=6, ignore_eos=True)
    forks = s.fork(2)
    forks += lambda i: f" Part {i}:" + sgl.gen("part", max_tokens=4, stop="\n", ignore_eos=True)
    forks.join()
    s += " The answer is " + sgl.select("pick", choices=CHOICES)


@sgl.function
def chat(s, question):
    s += sgl.system("You answer in one word.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    s += sgl.user("And again?")
    s += sgl.assistant(sgl.gen("again", max_tokens=8, top_k=1))


def test_completion_model_matches_the_native_backend(engine: Any, server: Server) -> None:
    oa = openai(engine, server, chat=False)
    local = sgl.Runtime(engine=engine)
    remote_state = story.run(topic="caches", backend=oa, **GREEDY)
    local_state = story.run(topic="caches", backend=local, **GREEDY)
    assert remote_state.text() == local_state.text()
    assert remote_state["part"] == local_state["part"]
    remote_meta, local_meta = remote_state.get_meta_info("pick"), local_state.get_meta_info("pick")
    assert remote_meta["normalized_prompt_logprobs"] == pytest.approx(
        local_meta["normalized_prompt_logprobs"], abs=1e-4
    )
    assert [[e[2] for e in es] for es in remote_meta["input_token_logprobs"]] == [
        [e[2] for e in es] for es in local_meta["input_token_logprobs"]
    ]
    meta = remote_state.get_meta_info("start")
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"
    assert oa.token_usage.completion_tokens == 6 + 2 * 4  # start, then two forks of 4 (ignore_eos: no early stop)
    assert oa.token_usage.prompt_tokens > 0
    assert meta["prompt_tokens"] == len(local.tokenize("A story about caches:"))


def test_completion_model_streams(engine: Any, server: Server) -> None:
    oa = openai(engine, server, chat=False)
    streamed = story.run(topic="trees", backend=oa, stream=True, **GREEDY)
    pieces = list(streamed.text_iter("start"))
    assert len(pieces) > 1 and "".join(pieces) == streamed["start"]
    assert streamed.text() == story.run(topic="trees", backend=sgl.Runtime(engine=engine), **GREEDY).text()
    assert streamed.get_meta_info("start")["completion_tokens"] == 6


def test_chat_model_sends_the_messages_and_matches_the_native_backend(engine: Any, server: Server) -> None:
    remote = chat.run(
        question="What is a radix tree?", backend=openai(engine, server, chat=True), temperature=1.0, top_k=1
    )  # top_k=1: greedy, so the two backends must agree; also checks top_k is sent
    local = chat.run(question="What is a radix tree?", backend=sgl.Runtime(engine=engine), **GREEDY)
    assert (remote["answer"], remote["again"]) == (local["answer"], local["again"])
    assert [m["role"] for m in remote.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert remote.messages()[4]["content"] == remote["again"]
    streamed = chat.run(
        question="What is a radix tree?", backend=openai(engine, server, chat=True), stream=True, **GREEDY
    )
    assert "".join(streamed.text_iter("again")) == local["again"]


def test_chat_model_needs_gen_right_after_assistant(engine: Any, server: Server) -> None:
    @sgl.function
    def loose(s):
        s += sgl.user("Hi") + "Answer:" + sgl.gen("x", max_tokens=3)

    with pytest.raises(sgl.ProgramError, match="right after sgl.assistant"):
        loose.run(backend=openai(engine, server, chat=True))


@pytest.mark.parametrize(
    "chat_model, body, named",
    [
        (True, lambda s: s.__iadd__(sgl.user("Hi") + sgl.assistant(sgl.select("x", choices=["a", "b"]))), "chat model"),
        (
            False,
            lambda s: s.__iadd__(
                "Hi" + sgl.select("x", choices=["a", "b"], choices_method=sgl.unconditional_likelihood_normalized)
            ),
            "unconditional",
        ),
        (False, lambda s: s.__iadd__("Hi" + sgl.gen("x", max_tokens=2, return_logprob=True)), "return_logprob"),
    ],
)
def test_what_the_openai_api_cannot_express_is_refused(
    engine: Any, server: Server, chat_model: bool, body: Any, named: str
) -> None:
    with pytest.raises(sgl.ProgramError, match=named) as info:
        sgl.function(body).run(backend=openai(engine, server, chat=chat_model))
    assert isinstance(info.value.cause, sgl.NotSupportedError)


def test_backend_level_calls(engine: Any, server: Server) -> None:
    oa = openai(engine, server, chat=False)
    assert sgl.get_server_info(oa)["model_name"] == engine.model_info()["model_name"]
    with pytest.raises(sgl.NotSupportedError, match="cache"):
        sgl.flush_cache(oa)
    with pytest.raises(sgl.ProgramError) as info:  # the key is sent: a wrong one is refused by the server
        sgl.function(lambda s: s.__iadd__("Hi" + sgl.gen("x", max_tokens=2))).run(
            backend=sgl.OpenAI(
                engine.model_info()["model_name"], base_url=server.url + "/v1", api_key="wrong", is_chat_model=False
            )
        )
    assert isinstance(info.value.cause, sgl.BackendError) and info.value.cause.status == 401
    with pytest.raises(sgl.NotSupportedError, match="is_azure"):
        sgl.OpenAI("gpt-4o", is_azure=True)
    with pytest.raises(sgl.NotSupportedError, match="chat_template"):
        sgl.OpenAI("gpt-4o", chat_template="chatml")
    assert sgl.OpenAI("gpt-3.5-turbo-instruct", False, base_url=server.url + "/v1").chat_only is False
