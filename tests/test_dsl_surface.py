"""SGLang's frontend surface, row by row of frontend_dsl/README.md, on both radixserve backends (in-process Runtime and
RuntimeEndpoint over HTTP) with the tiny model: meta_info keys, selection methods, text_async_iter, var_scope, fork
groups, run_batch options, refusals."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsl_server import Server

import frontend_dsl as sgl
from frontend_dsl.ir import REGEX_FLOAT, REGEX_INT
from radixserve.server.app import build_app

GREEDY = {"temperature": 0}
PREFIX = "The quick brown fox jumps over the lazy dog. The answer is "
CHOICES = ["dog", "forest into the fox", "x", "radix tree"]


@pytest.fixture
def engine(tiny_model_dir: Path, make_engine) -> Any:
    return make_engine(tiny_model_dir, page_size=16, max_total_tokens=16384)


@pytest.fixture(params=["runtime", "endpoint"])
def backend(request: pytest.FixtureRequest, engine: Any) -> Iterator[sgl.Backend]:
    if request.param == "runtime":
        yield sgl.Runtime(engine=engine)
        return
    server = Server(build_app(engine))
    try:
        yield sgl.RuntimeEndpoint(server.url)
    finally:
        server.stop()


def run(body: Any, backend: sgl.Backend, **kw: Any) -> sgl.ProgramState:
    return sgl.function(body).run(backend=backend, **{**GREEDY, **kw})


# ---- gen: meta_info and parameters ----------------------------------------------------------------------------------


def test_gen_meta_info_has_sglangs_keys_and_logprobs_when_asked(backend: sgl.Backend) -> None:
    def prog(s):
        s += "Hello there" + sgl.gen("plain", max_tokens=4)
        s += sgl.gen(
            "lp",
            max_tokens=3,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
        )

    state = run(prog, backend)
    plain = state.get_meta_info("plain")
    assert plain["completion_tokens"] == 4 and plain["finish_reason"]["type"] == "length"
    assert plain["prompt_tokens"] == len(backend.tokenize("Hello there")) and plain["cached_tokens"] >= 0
    assert "output_token_logprobs" not in plain
    lp = state.get_meta_info("lp")
    assert len(lp["output_token_logprobs"]) == 3 == lp["completion_tokens"]
    assert len(lp["input_token_logprobs"]) == lp["prompt_tokens"]  # logprob_start_len=0: every prompt token
    assert lp["input_token_logprobs"][0][0] is None  # the first token has no context
    assert all(len(top) == 2 for top in lp["output_top_logprobs"])
    for logprob, token_id, text in lp["output_token_logprobs"]:  # return_text_in_logprobs: (logprob, id, text)
        assert logprob <= 0 and isinstance(token_id, int) and isinstance(text, str)
    assert "".join(e[2] for e in lp["output_token_logprobs"]) == state["lp"]


def test_gen_sampling_parameters_reach_the_engine(backend: sgl.Backend) -> None:
    free = run(lambda s: s.__iadd__("Hello there" + sgl.gen("x", max_tokens=12, ignore_eos=True)), backend)
    first_id = backend.tokenize("Hello there" + free["x"])[len(backend.tokenize("Hello there"))]
    stop_text = free["x"][3:6]  # a stop string the greedy continuation is known to contain

    state = run(
        lambda s: s.__iadd__(
            "Hello there" + sgl.gen("long", max_tokens=12, ignore_eos=True, top_k=1, top_p=0.9, min_p=0.01)
        ),
        backend,
        temperature=1.0,
    )
    assert state["long"] == free["x"]  # top_k=1 samples greedily even at temperature 1
    by_id = run(
        lambda s: s.__iadd__("Hello there" + sgl.gen("g", max_tokens=12, stop_token_ids=[first_id])), backend
    ).get_meta_info("g")
    assert by_id["completion_tokens"] == 1 and by_id["finish_reason"]["type"] == "stop"
    state = run(lambda s: s.__iadd__("Hello there" + sgl.gen("g", max_tokens=12, stop=stop_text)), backend)
    assert state.get_meta_info("g")["finish_reason"]["type"] == "stop" and stop_text not in state["g"]
    penalized = run(
        lambda s: s.__iadd__(
            "Hello there" + sgl.gen("g", max_tokens=12, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
        ),
        backend,
    )
    assert penalized["g"] != free["x"]  # the tiny model repeats itself; the penalties change that


def test_stream_meta_info_accumulates_output_logprobs(backend: sgl.Backend) -> None:
    def prog(s):
        s += "Hello there" + sgl.gen("g", max_tokens=5, ignore_eos=True, return_logprob=True)

    state = run(prog, backend, stream=True)
    assert "".join(state.text_iter("g")) == state["g"]
    assert len(state.get_meta_info("g")["output_token_logprobs"]) == 5


# ---- select: meta_info and the three selection methods --------------------------------------------------------------


def test_select_meta_info_has_per_choice_logprob_lists(backend: sgl.Backend) -> None:
    def prog(s):
        s += PREFIX + sgl.gen("tool", choices=CHOICES)

    meta = run(prog, backend).get_meta_info("tool")
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(CHOICES) and meta["output_token_logprobs"] == [[] for _ in CHOICES]
    for choice, es, norm in zip(CHOICES, entries, meta["normalized_prompt_logprobs"]):
        assert "".join(e[2] for e in es).strip() == choice  # exactly the choice's own tokens
        assert norm == pytest.approx(sum(e[0] for e in es) / len(es))


def test_greedy_token_selection_compares_token_by_token(backend: sgl.Backend) -> None:
    def prog(s):
        s += PREFIX + sgl.select("pick", choices=CHOICES, choices_method=sgl.greedy_token_selection)

    state = run(prog, backend)
    matrix = state.get_meta_info("pick")["greedy_logprob_matrix"]
    remaining = list(range(len(CHOICES)))
    for j in range(len(matrix[0])):
        best = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == best]
        if len(remaining) == 1:
            break
    assert state["pick"] == CHOICES[remaining[0]]
    assert all(len(row) == len(matrix[0]) for row in matrix)


def test_unconditional_likelihood_normalized_scores_the_choices_without_the_prompt(
    backend: sgl.Backend, engine: Any
) -> None:
    def prog(s):
        s += PREFIX + sgl.select("pick", choices=CHOICES, choices_method=sgl.unconditional_likelihood_normalized)

    state = run(prog, backend)
    meta = state.get_meta_info("pick")
    for cond, uncond in zip(meta["input_token_logprobs"], meta["unconditional_token_logprobs"]):
        ids = [e[1] for e in cond]
        assert [e[1] for e in uncond] == ids and uncond[0][0] is None
        alone = engine.generate(
            input_ids=[ids], sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )[0]["meta_info"]["input_token_logprobs"]
        assert [e[0] for e in uncond[1:]] == pytest.approx([lp for lp, _ in alone[1:]], abs=1e-4)
    scores = meta["normalized_unconditional_prompt_logprobs"]
    assert state["pick"] == CHOICES[max(range(len(CHOICES)), key=lambda i: (scores[i], -i))]


@pytest.mark.parametrize(
    "method", [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized]
)
def test_select_with_no_text_before_it(backend: sgl.Backend, method: Any) -> None:
    state = run(lambda s: s.__iadd__(sgl.select("x", choices=CHOICES, choices_method=method)), backend)
    meta = state.get_meta_info("x")
    assert state.text() == state["x"] in CHOICES
    assert all(es[0][0] is None for es in meta["input_token_logprobs"])  # the first token has no context
    for es, v in zip(meta["input_token_logprobs"], meta["normalized_prompt_logprobs"]):
        assert math.isfinite(v) == (len(es) > 1)  # a one-token choice with no context has no logprob at all


def test_a_user_written_choices_method_gets_sglangs_keyword_arguments(backend: sgl.Backend) -> None:
    class Shortest(sgl.ChoicesSamplingMethod):
        def __call__(
            self,
            *,
            choices,
            normalized_prompt_logprobs,
            input_token_logprobs,
            output_token_logprobs,
            unconditional_token_logprobs=None,
        ):
            i = min(range(len(choices)), key=lambda k: len(input_token_logprobs[k]))
            return sgl.ChoicesDecision(choices[i], {"lengths": [len(e) for e in input_token_logprobs]})

    state = run(lambda s: s.__iadd__(PREFIX + sgl.select("pick", choices=CHOICES, choices_method=Shortest())), backend)
    lengths = state.get_meta_info("pick")["lengths"]
    assert state["pick"] == CHOICES[lengths.index(min(lengths))]


# ---- ProgramState --------------------------------------------------------------------------------------------------


async def test_text_async_iter_with_var_name_and_meta_data(backend: sgl.Backend) -> None:
    def prog(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("answer_1", max_tokens=4, ignore_eos=True))
        s += sgl.user("More") + sgl.assistant(sgl.gen("answer_2", max_tokens=6, ignore_eos=True, return_logprob=True))

    state = run(prog, backend, stream=True)
    pieces, metas = [], []
    async for out, meta in state.text_async_iter(var_name="answer_2", return_meta_data=True):
        pieces.append(out)
        metas.append(meta)
    assert "".join(pieces) == state["answer_2"] and len(pieces) > 1
    assert metas[-1]["completion_tokens"] == 6 and metas[-1]["finish_reason"]["type"] == "length"
    done = 0  # as SGLang: each piece comes with the logprobs of its own tokens, the length counts them all
    for meta in metas:
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - done
        done = meta["completion_tokens"]
    assert len(state.get_meta_info("answer_2")["output_token_logprobs"]) == 6
    whole = [out async for out in state.text_async_iter()]
    assert "".join(whole) == state.text()


def test_var_scope_get_set_var_and_contains(backend: sgl.Backend) -> None:
    def prog(s):
        s += "Q: "
        with s.var_scope("question"):
            s += "What is a " + sgl.gen("thing", max_tokens=3) + "?"
        s.set_var("note", 42)

    state = run(prog, backend)
    assert state.get_var("question") == "What is a " + state["thing"] + "?"
    assert state.get_var("note") == 42 and "note" in state and "nothing" not in state
    assert state.text() == "Q: " + state["question"]


def test_fork_groups_index_append_and_join_modes(backend: sgl.Backend) -> None:
    def prog(s):
        s += "Ideas:"
        forks = s.fork(3)
        forks += sgl.gen("idea", max_tokens=3)  # the whole group
        forks[1] += "!"
        forks.join()
        s += "|"
        more = s.fork(2)
        more += lambda i: f"[{i}]" + sgl.gen("tail", max_tokens=1)
        more.join("concate_and_append")
        s += "|"
        with s.copy() as c:
            c += sgl.gen("solo", max_tokens=2)

    state = run(prog, backend)
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3 and len(set(ideas)) == 1  # greedy: the same idea thrice
    tail = state.text().split("|")[1]
    assert tail.startswith("[0]") and "[1]" in tail and state.text().endswith("|")
    assert "tail" not in state  # concate_and_append appends text only
    assert isinstance(state["solo"], list) and len(state["solo"]) == 1
    with pytest.raises(sgl.ProgramError, match="join mode"):
        run(lambda s: s.fork(2).join("nonsense"), backend)


def test_sync_and_messages(backend: sgl.Backend) -> None:
    def prog(s):
        s += sgl.system("Be brief.")
        s += sgl.user_begin() + "Hi" + sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("a", max_tokens=3) + sgl.assistant_end()
        s.sync()

    state = run(prog, backend)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[2]["content"] == state["a"]


# ---- Program: run, run_batch ---------------------------------------------------------------------------------------


def test_run_batch_options(backend: sgl.Backend) -> None:
    @sgl.function
    def echo(s, word):
        s += "Say " + word + ":" + sgl.gen("out", max_tokens=2)

    inputs = [{"word": w} for w in ("a", "b", "c", "d")]
    states = echo.run_batch(inputs, backend=backend, num_threads=2, progress_bar=True, **GREEDY)
    gen = echo.run_batch(inputs, backend=backend, generator_style=True, **GREEDY)
    assert not isinstance(gen, list)
    assert [s.text() for s in gen] == [s.text() for s in states]
    assert [s.text().split(":")[0] for s in states] == ["Say a", "Say b", "Say c", "Say d"]
    single = echo.run("c", backend=backend, use_thread=False, **GREEDY)
    assert single.text() == states[2].text()


def test_run_level_logprob_args_and_bind(backend: sgl.Backend) -> None:
    @sgl.function
    def say(s, word, n):
        s += "Say " + word + ":" + sgl.gen("out", max_tokens=n) + sgl.gen("own", max_tokens=2, return_logprob=False)

    state = say.bind(n=3).run(
        "hi", backend=backend, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True, **GREEDY
    )
    meta = state.get_meta_info("out")
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_token_logprobs"][0]) == 3
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert "output_token_logprobs" not in state.get_meta_info("own")  # a gen's own setting wins
    with pytest.raises(TypeError, match="no argument"):
        say.bind(m=1)


def test_select_temperature_is_accepted_and_the_decision_is_the_argmax(backend: sgl.Backend) -> None:
    picks = {
        run(lambda s: s.__iadd__(PREFIX + sgl.select("x", choices=CHOICES, temperature=t)), backend)["x"]
        for t in (0.0, 0.7, 1.5)
    }
    assert len(picks) == 1


def test_group_appends_per_fork_and_error_reports_the_failure(backend: sgl.Backend) -> None:
    def prog(s):
        forks = s.fork(2)
        forks += ["A", "B"]
        forks += sgl.gen("x", max_tokens=2)
        forks.join()
        s += str([f.text()[:1] for f in forks])

    assert run(prog, backend).text() == "['A', 'B']"

    def bad(s):
        s += "Hi" + sgl.gen("x", max_tokens=10**6)

    state = sgl.function(bad).run(backend=backend, stream=True)
    with pytest.raises(sgl.ProgramError):
        list(state.text_iter())  # a streamed run reports its failure at the end of the stream
    assert isinstance(state.error(), sgl.ProgramError) and "context length" in str(state.error())
    with pytest.raises(sgl.ProgramError):
        state.sync()


def test_get_server_info_and_flush_cache(backend: sgl.Backend) -> None:
    info = sgl.get_server_info(backend)
    assert info["context_length"] > 0 and info["model_path"]
    assert sgl.flush_cache(backend) is True
    assert sgl.flush_cache(backend, empty_cache=False) is True
    assert sgl.Engine.__module__.startswith("radixserve")


# ---- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda: sgl.gen("x", dtype=complex), "dtype"),
        (lambda: sgl.gen("x", n=2), "n=2"),
        (lambda: sgl.image("cat.png"), "sgl.image"),
        (lambda: sgl.video("cat.mp4", 8), "sgl.video"),
        (lambda: sgl.separate_reasoning(sgl.gen("x")), "separate_reasoning"),
        (lambda: sgl.function(lambda s: None, num_api_spec_tokens=64), "num_api_spec_tokens"),
        (lambda: sgl.function(lambda s: None).trace(), "trace"),
        (lambda: sgl.function(lambda s: None).cache(), "cache"),
        (lambda: sgl.function(lambda s: None).compile(), "compile"),
    ],
)
def test_unsupported_calls_are_refused_naming_the_call(call: Any, named: str) -> None:
    with pytest.raises(sgl.NotSupportedError, match=named):
        call()


def test_constraints_become_sampling_params() -> None:
    assert sgl.gen("x", regex=r"\d+").params == {"regex": r"\d+"}
    # as SGLang's runtime backend sends them: the regex of sglang.lang.ir, and a number ends at a space or newline
    assert sgl.gen_int("x").params == {"regex": REGEX_INT, "stop": [" ", "\n"]}
    assert sgl.gen("x", dtype="float", stop=";").params == {"regex": REGEX_FLOAT, "stop": [";", " ", "\n"]}
    assert sgl.gen("x", min_tokens=2, stop_regex=r"\d").params == {"min_new_tokens": 2, "stop_regex": r"\d"}
    assert re.fullmatch(REGEX_INT, "-42 \n") and re.fullmatch(REGEX_FLOAT, "3.5\n")
    assert sgl.gen("x", json_schema={"type": "object"}).params == {"json_schema": {"type": "object"}}


def test_fork_position_ids_offset_is_refused(backend: sgl.Backend) -> None:
    with pytest.raises(sgl.ProgramError, match="position_ids_offset"):
        run(lambda s: s.fork(2, position_ids_offset=[0, 1]), backend)


def test_runtime_maps_warns_about_and_refuses_sglang_server_args(tiny_model_dir: Path) -> None:
    with pytest.warns(UserWarning, match="mem_fraction_static"):
        rt = sgl.Runtime(
            str(tiny_model_dir),
            tp_size=1,
            mem_fraction_static=0.8,
            disable_radix_cache=True,
            max_total_tokens=2048,
            dtype="float32",
            page_size=8,
        )
    try:
        assert rt.get_server_info()["page_size"] == 8 and rt.get_server_info()["dtype"] == "float32"
        again = [run(lambda s: s.__iadd__(PREFIX + sgl.gen("g", max_tokens=1)), rt) for _ in range(2)]
        assert again[1].get_meta_info("g")["cached_tokens"] == 0  # disable_radix_cache reached the engine
    finally:
        rt.shutdown()
    with pytest.raises(sgl.NotSupportedError, match="quantization"):
        sgl.Runtime(str(tiny_model_dir), quantization="awq")
    with pytest.raises(TypeError, match="unknown argument 'max_totl_tokens'"):
        sgl.Runtime(str(tiny_model_dir), max_totl_tokens=10)
