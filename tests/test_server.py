"""The HTTP server's OpenAI endpoints through the real `openai` SDK, and multi-turn cache hits (one tiny engine behind
a live uvicorn per module: tests/server_fixtures.py)."""

from __future__ import annotations


import time

import openai
import pytest

from radixserve import Engine
from server_fixtures import GREEDY, MESSAGES, page_floor
from server_fixtures import client, engine, http, model, server  # noqa: F401  (fixtures)

# ---------------------------------------------------------------- OpenAI SDK


def test_chat_matches_engine(client: openai.OpenAI, engine: Engine, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"cache_salt": "chat-eq"}
    )
    ref = engine.generate(
        input_ids=engine.apply_chat_template(MESSAGES),
        sampling_params={"max_new_tokens": 8, **GREEDY},
        cache_salt="chat-eq-ref",
    )
    assert r.object == "chat.completion" and r.model == model and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # first time in its namespace


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_content_parts(client: openai.OpenAI, model: str) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "fast fox."}]}]
    joined = [{"role": "user", "content": "Name a\nfast fox."}]
    a = client.chat.completions.create(model=model, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=model, messages=joined, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_forms(client: openai.OpenAI, engine: Engine, model: str) -> None:
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    refs = [engine.generate(p, {"max_new_tokens": 6, **GREEDY}) for p in prompts]
    one = client.completions.create(model=model, prompt=prompts[0], max_tokens=6, temperature=0)
    assert one.object == "text_completion" and one.choices[0].text == refs[0]["text"]
    many = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [r["text"] for r in refs]
    assert many.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in refs)
    ids = [engine.encode(p) for p in prompts]
    by_ids = client.completions.create(model=model, prompt=ids[1], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == refs[1]["text"]
    by_id_lists = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_id_lists.choices] == [r["text"] for r in refs]
    echoed = client.completions.create(model=model, prompt=prompts[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + refs[0]["text"]
    default_len = client.completions.create(
        model=model, prompt=prompts[0], temperature=0, extra_body={"ignore_eos": True}
    )
    assert default_len.usage.completion_tokens == 16  # the legacy endpoint's default max_tokens


def test_completions_stream(client: openai.OpenAI, model: str) -> None:
    prompts = ["Hello, world!", "import torch"]
    full = client.completions.create(model=model, prompt=prompts, max_tokens=7, temperature=0, echo=True)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompts,
            max_tokens=7,
            temperature=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in full.choices]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_sampling_and_seed(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1234, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # the samples draw differently
    assert a.usage.completion_tokens == b.usage.completion_tokens
    # streamed n=2 samples use the same per-sample seeds as the engine's n=2
    texts = ["", ""]
    for c in client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in a.choices]
    other = client.chat.completions.create(**{**kw, "seed": 99, "n": 1})
    assert other.choices[0].message.content != a.choices[0].message.content


def test_chat_logprobs(client: openai.OpenAI, engine: Engine, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    tok = engine.tokenizer
    for entry in content:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode())
    ids = engine.generate(
        input_ids=engine.apply_chat_template(MESSAGES), sampling_params={"max_new_tokens": 5, **GREEDY}
    )["output_ids"]
    assert [e.token for e in content] == [tok.token_to_str(i) for i in ids]
    streamed = [
        c
        for c in client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, stream=True
        )
        if c.choices
    ]
    lps = [e.logprob for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs_echo(client: openai.OpenAI, engine: Engine, model: str) -> None:
    prompt = "The quick brown fox"
    n_prompt = len(engine.encode(prompt))
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    assert len(plain.choices[0].logprobs.tokens) == 4
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)


def test_models_endpoint(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]


# ---------------------------------------------------------------- multi-turn cache hits


def test_multi_turn_chat_hits_the_cache(client: openai.OpenAI, engine: Engine, model: str) -> None:
    """Each turn's prompt extends the previous prompt + answer, so the cache serves all of it but the last page."""
    messages = [{"role": "system", "content": "You are terse."}]
    prev_context = 0
    for turn, question in enumerate(["Hi there!", "Tell me more.", "Why?", "Thanks, bye."]):
        messages.append({"role": "user", "content": question})
        before = engine.metrics()["cached_tokens_total"]
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, extra_body={"cache_salt": "multi-turn"}
        )
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached == engine.metrics()["cached_tokens_total"] - before  # what the engine counted
        if turn == 0:
            assert cached == 0
        else:
            # everything of the previous turn whose KV was computed (all but its last sampled token), in full pages
            assert cached >= page_floor(prev_context - 1), (turn, cached, prev_context)
        answer = r.choices[0].message.content
        prev_context = r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append({"role": "assistant", "content": answer})


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_multi_turn_keeps_generated_ids_when_retokenizing_differs(
    client: openai.OpenAI, engine: Engine, model: str
) -> None:
    """A sampled answer whose text re-tokenizes into other ids: turn 2 still hits the cache over the whole answer."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 0}
    prompt1 = engine.apply_chat_template(messages)
    ref = engine.generate(input_ids=prompt1, sampling_params=params, cache_salt="retok-ref")
    generated = ref["output_ids"]
    assert engine.tokenizer.encode(ref["text"], add_special_tokens=False) != generated  # the case this test is about

    salt = {"cache_salt": "retok"}
    r1 = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=1.0, seed=0, extra_body=salt
    )
    assert r1.choices[0].message.content == ref["text"]
    messages += [{"role": "assistant", "content": ref["text"]}, {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, extra_body=salt)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= page_floor(len(prompt1) + len(generated) - 1)
    # a plain re-render would have lost the hit where the answer starts
    naive = engine.apply_chat_template(messages)
    assert page_floor(common_prefix(naive, prompt1 + generated)) < cached


def test_multi_turn_streaming_hits_the_cache(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Count with me."}]
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "stream-turns"},
        )
    )
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first = chunks[-1].usage
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, temperature=0, extra_body={"cache_salt": "stream-turns"}
    )
    assert r.usage.prompt_tokens_details.cached_tokens >= page_floor(first.prompt_tokens + first.completion_tokens - 1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("form", ["prompts", "n"])
def test_a_request_of_several_prompts_or_samples_reaches_the_scheduler_whole(
    client: openai.OpenAI, engine: Engine, model: str, monkeypatch, stream: bool, form: str
) -> None:
    """An HTTP request's prompts (or its n samples) are queued in one message, however slowly each is built, so they
    get the steps an engine batch gets (Engine.run_all / stream_all; without deterministic mode a row's bits depend
    on what shares its steps: radixserve/engine_requests.py)."""
    build = engine.inputs.make_req

    def slow(*args, **kwargs):
        time.sleep(0.05)  # the loop thread would take the requests queued so far meanwhile
        return build(*args, **kwargs)

    steps: list[int] = []
    forward = engine.runner.forward

    def recorded(batch):
        steps.append(len(batch.extend_lens))
        return forward(batch)

    monkeypatch.setattr(engine.inputs, "make_req", slow)
    monkeypatch.setattr(engine.runner, "forward", recorded)
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]
    kw = dict(prompt=prompts) if form == "prompts" else dict(prompt=prompts[0], n=3, seed=5)
    # ignore_eos: a sampled end would finish a row early and change the later steps' sizes by chance
    params = {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "seed": 5,
        "ignore_eos": True,
        "n": 1 if form == "prompts" else 3,
    }
    engine.generate(kw["prompt"], params, cache_salt=f"whole-ref-{stream}-{form}")  # nothing cached: all prefilled
    want, steps[:] = list(steps), []
    out = client.completions.create(
        model=model,
        max_tokens=4,
        temperature=0.7,
        stream=stream,
        extra_body={"cache_salt": f"whole-{stream}-{form}", "ignore_eos": True},
        **kw,
    )
    if stream:
        assert len({c.choices[0].index for c in out if c.choices}) == 3
    else:
        assert len(out.choices) == 3
    assert steps == want
    assert want[0] == 3 if form == "prompts" else want[0] == 1  # n: the prompt is prefilled alone first
