"""SGLang-style programs of our own writing (few-shot, forks, select, regex/JSON/int gens, streaming with logprobs,
min_new_tokens, batches), run by tests/test_sglang_real_client.py under SGLang's own frontend (`import sglang`) and by
tests/test_dsl_sglang_style_programs.py under frontend_dsl: the same code, only the module bound to `sgl` differs.

Standalone: `python tests/sglang_style_programs.py URL [sglang|frontend_dsl]` runs every program against the server
at URL and prints one JSON object {program: "ok" or the failure}. It imports neither pytest nor radixserve, so it runs
in a venv that holds only SGLang's frontend. Models here are tiny random ones: the checks are about structure (what
a constraint, stop or fork guarantees), never about what the text says."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

PROGRAMS: dict[str, Callable[[Any], None]] = {}


def program(f: Callable[[Any], None]) -> Callable[[Any], None]:
    PROGRAMS[f.__name__] = f
    return f


@program
def few_shot(sgl: Any) -> None:
    @sgl.function
    def capitals(s, country):
        s += "Country: Italy\nCapital: Rome\n\nCountry: Japan\nCapital: Tokyo\n\n"
        s += "Country: " + country + "\nCapital:" + sgl.gen("capital", max_tokens=8, stop="\n", temperature=0)

    state = capitals.run(country="Peru")
    assert "\n" not in state["capital"]
    assert state.text().endswith(state["capital"])
    again = capitals.run(country="Peru")  # greedy and the prefix cached: the same answer
    assert again["capital"] == state["capital"]


@program
def fork_and_join(sgl: Any) -> None:
    @sgl.function
    def tips(s):
        s += "Two tips for a long walk:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=6, temperature=0, ignore_eos=True)
        s += "1." + forks[0]["tip"] + "\n2." + forks[1]["tip"] + "\n"

    state = tips.run()
    assert state.text().startswith("Two tips for a long walk:\n1.")
    assert state.text().count("\n") >= 3


@program
def select_and_score(sgl: Any) -> None:
    @sgl.function
    def colour(s):
        s += "The sky on a clear day is"
        s += sgl.select("colour", choices=[" blue", " green", " red"])

    state = colour.run()
    assert state["colour"] in (" blue", " green", " red")
    meta = state.get_meta_info("colour")
    assert len(meta["normalized_prompt_logprobs"]) == 3


@program
def regex_gen(sgl: Any) -> None:
    @sgl.function
    def phone(s):
        s += "Call us at " + sgl.gen("number", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16, temperature=0)

    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.run()["number"])


@program
def json_gen(sgl: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "adult": {"type": "boolean"}},
        "required": ["name", "adult"],
        "additionalProperties": False,
    }

    @sgl.function
    def person(s):
        s += "A person as JSON: " + sgl.gen("json", json_schema=json.dumps(schema), max_tokens=128, temperature=0)

    out = json.loads(person.run()["json"])
    assert set(out) == {"name", "adult"} and isinstance(out["adult"], bool)


@program
def typed_int(sgl: Any) -> None:
    @sgl.function
    def count(s):
        s += "How many legs has a spider? " + sgl.gen_int("legs", max_tokens=12, temperature=0) + " legs."

    value = count.run()["legs"]
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", value), value
    int(value)


@program
def stream_text(sgl: Any) -> None:
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=24, temperature=0, ignore_eos=True)

    whole = story.run()["story"]
    state = story.run(stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == whole == state["story"]


@program
def stream_logprobs(sgl: Any) -> None:
    @sgl.function
    def story(s):
        s += "The river" + sgl.gen("more", max_tokens=12, temperature=0, ignore_eos=True, return_logprob=True)

    async def chunks(state: Any) -> list[tuple[str, dict]]:
        return [c async for c in state.text_async_iter("more", return_meta_data=True)]

    state = story.run(stream=True)
    got = asyncio.run(chunks(state))
    assert got and "".join(text for text, _ in got) == state["more"]
    for text, meta in got:
        assert text and meta["output_token_logprobs_length"] == meta["completion_tokens"]
    final = state.get_meta_info("more")
    assert final["completion_tokens"] == 12 == len(final["output_token_logprobs"])
    assert all(entry[0] <= 0 for entry in final["output_token_logprobs"])


@program
def min_new_tokens(sgl: Any) -> None:
    @sgl.function
    def words(s, min_tokens):
        s += "List:" + sgl.gen("rest", max_tokens=20, min_tokens=min_tokens, stop=[" ", "\n", ","], temperature=0)

    held = words.run(min_tokens=8)
    assert held.get_meta_info("rest")["completion_tokens"] >= 8


@program
def batch_and_roles(sgl: Any) -> None:
    @sgl.function
    def answer(s, question):
        s += sgl.system("Answer in a few words.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))

    questions = ["What is red?", "What is blue?", "What is green?"]
    states = answer.run_batch([{"question": q} for q in questions])
    assert len(states) == 3
    for q, state in zip(questions, states):
        assert q in state.text() and state["answer"] in state.text()


@program
def server_info(sgl: Any) -> None:
    info = sgl.get_server_info()
    assert info["incremental_streaming_output"] is False and "context_length" in info


def run_all(sgl: Any, url: str) -> dict[str, str]:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    results: dict[str, str] = {}
    for name, prog in PROGRAMS.items():
        try:
            prog(sgl)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - a program's failure is its result, reported by name
            results[name] = traceback.format_exc(limit=4)
    return results


if __name__ == "__main__":
    module = importlib.import_module(sys.argv[2] if len(sys.argv) > 2 else "sglang")
    print(json.dumps(run_all(module, sys.argv[1])))
