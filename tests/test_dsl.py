"""frontend_dsl on the in-process Engine (tiny model): semantics, cache mapping, select scoring, streaming, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import frontend_dsl as sgl
from frontend_dsl.backends.base import common_prefix_len
from frontend_dsl.prefix_gate import PrefixGate
from frontend_dsl.roles import RoleTemplates
from radixserve.tokenizer import Tokenizer

GREEDY = {"temperature": 0}
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A radix tree stores prefixes of token sequences so that shared prompts reuse cached keys and values.",
    "Hello, world! How are you today? I'm fine, thanks.",
    "def fibonacci(n: int) -> int:\n    return n\n",
]


def text_of_tokens(rt: sgl.Runtime, n: int) -> str:
    """A text of at least n tokens (English and code from the tokenizer's training text)."""
    text, i = "", 0
    while len(rt.tokenize(text)) < n:
        text += SENTENCES[i % len(SENTENCES)] + " "
        i += 1
    return text


@pytest.fixture
def rt(tiny_model_dir: Path, make_engine) -> sgl.Runtime:
    return sgl.Runtime(engine=make_engine(tiny_model_dir, page_size=16, max_total_tokens=16384))


def record_calls(rt: sgl.Runtime, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record every generate request the DSL sends to rt (the keyword arguments), in order."""
    calls: list[dict[str, Any]] = []
    real = rt.generate

    def recording(**kw: Any) -> Any:
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(rt, "generate", recording)
    return calls


PREFILL = {"max_new_tokens": 0}


@pytest.fixture
def default_backend_cleared():
    yield
    sgl.set_default_backend(None)


# ---- expressions and roles (no model) ---------------------------------------------------------------------------


def test_expressions_concatenate_and_bad_arguments_fail_where_written() -> None:
    e = "Q: " + sgl.gen("a", max_tokens=3) + "\n"
    assert [type(x).__name__ for x in e.items] == ["Text", "Gen", "Text"]
    assert e.items[1].params == {"max_new_tokens": 3}
    assert type(sgl.gen("c", choices=["x", "y"])).__name__ == "Select"
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen("x", stop_regex="(")
    with pytest.raises(ValueError, match="min_new_tokens"):
        sgl.gen("x", max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        sgl.gen("x", temperature=-1)
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("x", choices=["a", ""])
    with pytest.raises(sgl.NotSupportedError, match="fork"):
        sgl.gen("x", n=2)


def test_role_segments_concatenate_to_the_template_rendering_of_the_conversation(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    roles = RoleTemplates(lambda m: tok.apply_chat_template(m, add_generation_prompt=False))
    convo = [
        ("system", "Be brief."),
        ("user", "Hi there"),
        ("assistant", "Hello!"),
        ("user", "Bye"),
        ("assistant", "See you."),
    ]
    for start in (0, 1):  # with and without a system message (the template then adds its default one)
        msgs = convo[start:]
        built = ""
        for i, (role, content) in enumerate(msgs):
            seg = roles.segment(role, first=i == 0)
            built += seg.prefix + content + seg.suffix
        full = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=False)
        assert built == full
    # the assistant prefix is the generation prompt
    ctx = [{"role": "user", "content": "Hi"}]
    gen_prompt = tok.apply_chat_template(ctx, True)[len(tok.apply_chat_template(ctx, False)) :]
    assert roles.segment("assistant", first=False).prefix == gen_prompt
    # the tiny template allows a system message only first: a clear error, not a wrong prompt
    with pytest.raises(ValueError, match="system"):
        roles.segment("system", first=False)


def test_prefix_gate_prefills_the_common_prefix_once_all_programs_arrived_or_left() -> None:
    import threading
    import time

    prefilled: list[str] = []
    gate = PrefixGate(prefilled.append, expected=3)
    a, b, c = gate.ticket(), gate.ticket(), gate.ticket()
    waiting = [
        threading.Thread(target=a.arrive, args=("You are a librarian. Q: 1",)),
        threading.Thread(target=b.arrive, args=("You are a librarian. Q: 22",)),
    ]
    for t in waiting:
        t.start()
    time.sleep(0.1)
    assert all(t.is_alive() for t in waiting) and prefilled == []  # held until the third program says something
    c.leave()  # it finished without calling the backend
    for t in waiting:
        t.join(timeout=5)
    assert prefilled == ["You are a librarian. Q: "]
    a.arrive("later calls pass straight through")
    assert prefilled == ["You are a librarian. Q: "]

    slow = PrefixGate(prefilled.append, expected=2, timeout_s=0.2)
    t0 = time.monotonic()
    slow.ticket().arrive("alone")  # the other program never shows up: the timeout opens the gate
    assert time.monotonic() - t0 < 2 and prefilled == ["You are a librarian. Q: "]


# ---- semantics --------------------------------------------------------------------------------------------------


def test_greedy_gen_equals_engine_generate_on_the_rendered_prompt(rt: sgl.Runtime) -> None:
    @sgl.function
    def chat(s, q1, q2):
        s += sgl.system("You are terse.")
        s += sgl.user(q1)
        s += sgl.assistant(sgl.gen("a1", max_tokens=12))
        s += sgl.user(q2)
        s += sgl.assistant(sgl.gen("a2", max_tokens=12))

    state = chat.run(q1="What is a radix tree?", q2="And a page?", backend=rt, **GREEDY)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == rt.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    for k, name in ((2, "a1"), (4, "a2")):
        prompt = rt.engine.tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True)
        assert state.text().startswith(prompt)
        ref = rt.engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})
        assert state[name] == ref["text"] == msgs[k]["content"]


def test_run_sampling_args_apply_to_gens_without_their_own(rt: sgl.Runtime) -> None:
    @sgl.function
    def two(s):
        s += "Numbers: 1 2 3" + sgl.gen("default") + "\nMore:" + sgl.gen("own", max_tokens=5)

    state = two.run(backend=rt, max_new_tokens=3, ignore_eos=True, temperature=0)
    assert state.get_meta_info("default")["completion_tokens"] == 3
    assert state.get_meta_info("own")["completion_tokens"] == 5


def test_streaming_yields_text_as_produced_and_adds_up_to_the_state(rt: sgl.Runtime) -> None:
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=10, ignore_eos=True) + "\nThe end:"
        s += sgl.gen("end", max_tokens=4, ignore_eos=True)

    state = story.run(backend=rt, stream=True, **GREEDY)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()
    assert len(pieces) >= 10  # token by token, not one piece per gen
    assert "".join(state.text_iter("story")) == state["story"]
    plain = story.run(backend=rt, **GREEDY)
    assert plain.text() == state.text()


# ---- cache mapping ----------------------------------------------------------------------------------------------


def test_fork_computes_the_shared_prefix_once(rt: sgl.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = text_of_tokens(rt, 500)
    prefix_ids = rt.tokenize(prefix)
    n_prefix = len(prefix_ids)
    tails = [f"Branch {i}: the answer is" for i in range(4)]

    @sgl.function
    def branches(s):
        s += prefix
        forks = s.fork(4)
        for f, tail in zip(forks, tails):
            f += tail + sgl.gen("out", max_tokens=4)
        forks.join()

    calls = record_calls(rt, monkeypatch)
    before = rt.metrics()["computed_prefill_tokens_total"]
    state = branches.run(backend=rt, **GREEDY)
    # the DSL prefills the shared text before any branch runs (the engine also holds back requests admitted in the
    # same step that share a first uncached page; the DSL does not rely on that)
    assert calls[0] == {"text": prefix, "sampling_params": PREFILL}
    assert len(calls) == 5 and all(c["text"].startswith(prefix) for c in calls[1:])
    computed = rt.metrics()["computed_prefill_tokens_total"] - before
    page = rt.cache_stats()["page_size"]
    tail_ids = [rt.tokenize(prefix + t) for t in tails]
    tail_tokens = [len(ids) - common_prefix_len(prefix_ids, ids) for ids in tail_ids]
    # prefix once, plus per branch its tail and at most the prefix's partial last page again
    assert n_prefix <= computed <= n_prefix + sum(t + page for t in tail_tokens)
    assert computed < 2 * n_prefix  # not 4 x prefix
    outs = state["out"]
    assert len(outs) == 4
    for tail, out in zip(tails, outs):  # and each branch is what a plain request on its text gives
        ref = rt.engine.generate(prompt=prefix + tail, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out == ref["text"]


def test_run_batch_runs_concurrently_and_computes_the_common_prefix_once(
    rt: sgl.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = text_of_tokens(rt, 300)

    @sgl.function
    def answer(s, question):
        s += system + "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=3)

    questions = [{"question": f"what is item number {i}?"} for i in range(16)]
    calls = record_calls(rt, monkeypatch)
    before = rt.metrics()["computed_prefill_tokens_total"]
    states = answer.run_batch(questions, backend=rt, num_threads=16, **GREEDY)
    computed = rt.metrics()["computed_prefill_tokens_total"] - before
    # all 16 programs reached their first call before it went out; their common prefix was prefilled first, once
    assert calls[0] == {"text": system + "Question: what is item number ", "sampling_params": PREFILL}
    assert len(calls) == 17 and all(c["sampling_params"] != PREFILL for c in calls[1:])
    monkeypatch.undo()
    n_system = len(rt.tokenize(system))
    assert computed < n_system + 16 * 40  # about system + 16 tails, far below 16 x system (~4800)
    for q, st in zip(questions, states):
        assert st["answer"] == answer.run(backend=rt, **q, **GREEDY)["answer"]


# ---- select -----------------------------------------------------------------------------------------------------


def hf_mean_logprobs(model_dir: Path, rt: sgl.Runtime, prefix: str, choices: list[str]) -> list[float]:
    """Mean logprob of each choice's tokens after prefix, computed independently with transformers (float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix_ids = rt.tokenize(prefix)
    means = []
    for c in choices:
        ids = rt.tokenize(prefix + c)
        start = common_prefix_len(prefix_ids, ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        lps = [logp[p - 1, ids[p]].item() for p in range(max(start, 1), len(ids))]
        means.append(sum(lps) / len(lps))
    return means


def test_select_picks_the_highest_mean_logprob_choice_as_transformers_scores_it(
    rt: sgl.Runtime, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = "The quick brown fox jumps over the lazy dog. The answer is "
    # one-token, multi-token and boundary-merging choices (" " ends the prefix; the choices start with letters)
    choices = ["dog", "forest into the fox", "x", "radix tree", "Hello"]
    calls = record_calls(rt, monkeypatch)

    @sgl.function
    def pick(s):
        s += prefix + sgl.select("choice", choices=choices)

    state = pick.run(backend=rt)
    expected = hf_mean_logprobs(tiny_model_dir, rt, prefix, choices)
    scores = state.get_meta_info("choice")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(expected, abs=2e-3)
    assert state["choice"] == choices[max(range(len(choices)), key=lambda i: expected[i])]
    assert state.text() == prefix + state["choice"]
    # one prefill of the prefix, then ONE batched call scoring every choice
    assert len(calls) == 2
    assert calls[0] == {"text": prefix, "sampling_params": PREFILL}
    assert len(calls[1]["input_ids"]) == len(choices) and calls[1]["return_logprob"]


# ---- programs: forks, variables, errors ------------------------------------------------------------------------


def test_nested_forks_and_variables_read_back_in_the_parent(rt: sgl.Runtime) -> None:
    @sgl.function
    def tree(s):
        s += "Plan:"
        plans = s.fork(2)
        plans += sgl.gen("plan", max_tokens=3)
        leaves = []
        for p in plans:
            sub = p.fork(2)
            sub += lambda i: f" option {i}:" + sgl.gen("leaf", max_tokens=2)
            leaves.append(sub)
        s += "Best: " + plans[1]["plan"]
        return [[leaf["leaf"] for leaf in sub] for sub in leaves]

    state = tree.run(backend=rt, **GREEDY)
    assert len(state.ret_value) == 2 and all(len(x) == 2 for x in state.ret_value)
    assert state.text().startswith("Plan:Best: ")
    assert "plan" not in state  # not joined: fork variables stay in the forks


def test_an_exception_in_a_program_surfaces_with_its_name_and_state(rt: sgl.Runtime) -> None:
    @sgl.function
    def broken(s):
        s += "Step one." + sgl.gen("x", max_tokens=2)
        if s["x"] is not None:
            raise KeyError("no such tool")

    with pytest.raises(sgl.ProgramError) as info:
        broken.run(backend=rt, **GREEDY)
    err = info.value
    assert err.program_name == "broken" and isinstance(err.cause, KeyError)
    assert "broken" in str(err) and "Step one." in str(err) and err.state_text.startswith("Step one.")


def test_a_failing_backend_call_surfaces_as_a_clear_error_and_later_appends_do_not_run(rt: sgl.Runtime) -> None:
    @sgl.function
    def too_long(s):
        s += "Hi" + sgl.gen("x", max_tokens=100000)
        s += "never" + sgl.gen("y", max_tokens=1)

    with pytest.raises(sgl.ProgramError) as info:
        too_long.run(backend=rt)
    assert isinstance(info.value.cause, sgl.BackendError)
    assert "context length" in str(info.value)
    assert info.value.state_text == "Hi"

    state = too_long.run(backend=rt, stream=True)
    with pytest.raises(sgl.ProgramError):
        list(state.text_iter())


def test_run_without_any_backend_says_how_to_set_one(default_backend_cleared) -> None:
    @sgl.function
    def f(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="set_default_backend"):
        f.run()


def test_run_batch_reports_the_failing_input(rt: sgl.Runtime) -> None:
    @sgl.function
    def f(s, n):
        s += "Count:" + sgl.gen("x", max_tokens=n)

    with pytest.raises(sgl.ProgramError) as info:
        f.run_batch([{"n": 2}, {"n": 10**6}, {"n": 2}], backend=rt, **GREEDY)
    assert any("input #1" in note for note in info.value.__notes__)
