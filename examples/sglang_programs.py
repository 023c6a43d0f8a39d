"""SGLang's quick-start programs as SGLang users write them (only the import differs): tool use that reads the
choice's logprobs, a chat streamed to asyncio with text_async_iter, and select with each selection method.

    python examples/sglang_programs.py [--model PATH | --url http://127.0.0.1:30000]
"""

from __future__ import annotations

import asyncio

from common import HitRate, open_backend, parse_args, sgl


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression", max_tokens=24, stop="\n")
    else:
        s += "The key word to search is" + sgl.gen("word", max_tokens=24, stop="\n")


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=64))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=64))


@sgl.function
def capital(s, country, method):
    s += sgl.user(f"What is the capital of {country}? Answer with the city only.")
    s += sgl.assistant(sgl.select("city", choices=["Paris", "Berlin", "Madrid", "Rome"], choices_method=method))


async def stream_answer_2() -> None:
    state = multi_turn_question.run(
        question_1="What is the capital of the United Kingdom?",
        question_2="List two local attractions.",
        stream=True,
        temperature=0,
    )
    async for out in state.text_async_iter(var_name="answer_2"):
        print(out, end="", flush=True)
    print()


def main() -> None:
    args = parse_args("SGLang's quick-start programs on radixserve.")
    with open_backend(args) as backend:
        sgl.set_default_backend(backend)
        hits = HitRate(backend)
        state = tool_use.run(question="What is 39 + 3?", temperature=0)
        meta = state.get_meta_info("tool")
        print(f"tool: {state['tool']}  normalized_prompt_logprobs: {meta['normalized_prompt_logprobs']}")
        print(f"tokens scored per choice: {[len(e) for e in meta['input_token_logprobs']]}")
        print(state.text(), "\n")
        asyncio.run(stream_answer_2())
        for method in (
            sgl.token_length_normalized,
            sgl.greedy_token_selection,
            sgl.unconditional_likelihood_normalized,
        ):
            print(f"{type(method).__name__}: {capital.run(country='France', method=method)['city']}")
        print(hits.report())


if __name__ == "__main__":
    main()
