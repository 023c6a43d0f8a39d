"""Programs written against SGLang's documented frontend API run unchanged but for `import frontend_dsl as sgl`.

Each program below uses only the documented surface (decorator, gen/select, roles and their begin/end and `with`
forms, fork with `forks += ...`, `s[...]`, messages(), text_iter(), run/run_batch with sampling args, ret_value,
set_default_backend); the backend is set once, as SGLang programs do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend_dsl as sgl


@pytest.fixture(autouse=True)
def default_backend(tiny_model_dir: Path, make_engine) -> Iterator[None]:
    sgl.set_default_backend(sgl.Runtime(engine=make_engine(tiny_model_dir, max_total_tokens=16384)))
    yield
    sgl.set_default_backend(None)


# 1. quick start: a chat with roles, run, messages, streaming ------------------------------------------------------


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=16))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=16))


def test_quick_start_chat() -> None:
    state = multi_turn_question.run(
        question_1="What is the capital of the United States?",
        question_2="List two local attractions.",
        temperature=0,
    )
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == state["answer_1"]
    assert state.messages()[4]["content"] == state["answer_2"]

    state = multi_turn_question.run(question_1="What is 1+1?", question_2="And 2+2?", stream=True, temperature=0)
    streamed = "".join(out for out in state.text_iter())
    assert streamed == state.text() and state["answer_2"] in streamed


# 2. few-shot classification with select ---------------------------------------------------------------------------


@sgl.function
def few_shot_sentiment(s, review):
    s += "Classify the sentiment of each review.\n\n"
    s += "Review: I loved every minute of it.\nSentiment: positive\n\n"
    s += "Review: A waste of money, it broke on day one.\nSentiment: negative\n\n"
    s += "Review: It arrived on Tuesday.\nSentiment: neutral\n\n"
    s += "Review: " + review + "\nSentiment: "
    s += sgl.select("sentiment", choices=["positive", "negative", "neutral"])
    s += "\nConfidence: " + sgl.gen("confidence", choices=["high", "low"])


def test_few_shot_classification_with_select() -> None:
    reviews = ["Great value, works perfectly.", "Terrible support.", "The box is blue."]
    states = few_shot_sentiment.run_batch([{"review": r} for r in reviews])
    for review, state in zip(reviews, states):
        assert state["sentiment"] in ("positive", "negative", "neutral")
        assert state["confidence"] in ("high", "low")
        assert state.text().endswith(f"{review}\nSentiment: {state['sentiment']}\nConfidence: {state['confidence']}")


# 3. tree of thought: nested forks ----------------------------------------------------------------------------------


def propose_plan(s, question, num_branches):
    s += sgl.user("Please generate a high-level plan to answer this question: " + question)
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.gen("plan", max_tokens=12, temperature=0.7))
    return forks


def execute_plan(s, num_branches):
    s += sgl.user("The plan looks good! Now, carry it out and give a short answer.")
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0.7))
    return forks


def reflect_solution(s, num_branches):
    s += sgl.user("Is the answer right? Reply with one word.")
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.select("verdict", choices=["correct", "wrong"]))
    return forks


@sgl.function
def tree_search(s, question, num_branches):
    plan_forks = propose_plan(s, question, num_branches)
    solutions = []
    for plan in plan_forks:
        sol_forks = execute_plan(plan, num_branches)
        for sol in sol_forks:
            verdicts = reflect_solution(sol, num_branches)
            votes = sum(v["verdict"] == "correct" for v in verdicts)
            solutions.append((sol["answer"], votes))
    return solutions


def test_tree_of_thought_with_nested_forks() -> None:
    state = tree_search.run(question="How many legs do three spiders have?", num_branches=2)
    solutions = state.ret_value
    assert len(solutions) == 4  # 2 plans x 2 executions
    assert all(isinstance(a, str) and 0 <= v <= 2 for a, v in solutions)
    # the parent holds the question; the plans, answers and verdicts live in the forks
    assert [m["role"] for m in state.messages()] == ["user"]
    assert "plan" not in state and state.text().rstrip().endswith(state.messages()[0]["content"] + "<|im_end|>")


# 4. multi-turn conversation: `with` roles, begin/end, reading answers between turns ------------------------------


@sgl.function
def conversation(s, turns):
    s += sgl.system("You are a patient tutor.")
    for i, question in enumerate(turns):
        with s.user():
            s += question
        s += sgl.assistant_begin()
        s += sgl.gen(f"reply_{i}", max_tokens=10, stop=["\n\n"])
        s += sgl.assistant_end()
        if len(s[f"reply_{i}"]) > 1000:  # control flow on a generated value
            break


def test_multi_turn_conversation() -> None:
    turns = ["What is a prefix?", "And a suffix?", "Give an example of both."]
    state = conversation.run(turns=turns, max_new_tokens=32, temperature=0)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in msgs[1::2]] == turns
    assert [m["content"] for m in msgs[2::2]] == [state[f"reply_{i}"] for i in range(3)]


# 5. run_batch over 16 inputs ---------------------------------------------------------------------------------------


@sgl.function
def text_qa(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=8)


def test_run_batch_over_16_inputs() -> None:
    questions = [f"What is {i} plus {i}?" for i in range(16)]
    states = text_qa.run_batch([{"question": q} for q in questions], temperature=0, progress_bar=True)
    assert len(states) == 16
    for q, state in zip(questions, states):
        assert state.text() == f"Q: {q}\nA:" + state["answer"]
        assert "\n" not in state["answer"]
    # the same answers as one at a time
    assert [st["answer"] for st in states[:3]] == [
        text_qa.run(question=q, temperature=0)["answer"] for q in questions[:3]
    ]


# 6. tool use: gen with choices, then the choice's logprobs from meta_info ---------------------------------------


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression", max_tokens=8)
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word", max_tokens=8)


def test_tool_use_reads_the_choices_logprobs() -> None:
    state = tool_use.run(question="What is 39 + 3?", temperature=0)
    meta = state.get_meta_info("tool")
    assert len(meta["input_token_logprobs"]) == 2 and len(meta["normalized_prompt_logprobs"]) == 2
    assert len(meta["output_token_logprobs"]) == 2
    assert ("expression" in state) == (state["tool"] == "calculator")


# 7. asyncio streaming of one variable ------------------------------------------------------------------------------


async def test_async_stream_of_one_answer() -> None:
    state = multi_turn_question.run(
        question_1="What is the capital of France?",
        question_2="List two local attractions.",
        stream=True,
        temperature=0,
    )
    pieces = [out async for out in state.text_async_iter(var_name="answer_2")]
    assert "".join(pieces) == state["answer_2"] and len(pieces) > 1
