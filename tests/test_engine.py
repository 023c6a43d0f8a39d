"""Engine behaviour on a tiny model: cache accounting, memory pressure, aborts, sampling, namespaces, streaming."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from engine_checks import abort_after, leave_stream_after, wait_idle

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("partial", [False, True])
def test_repeated_prompt_reports_cached_tokens(tiny_model_dir: Path, make_engine, partial: bool) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048, enable_partial_page_reuse=partial)
    prompt = rand_ids(random.Random(1), 70)
    first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    second = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # 4 full pages; with partial-page reuse also the 5 rows of the first request's partial page the prompt matches
    assert second["meta_info"]["cached_tokens"] == (69 if partial else 64)  # never the last token: it is computed
    assert second["output_ids"] == first["output_ids"]
    exact = eng.generate(input_ids=prompt[:64], sampling_params=GREEDY)
    # never the whole prompt: at least one token is computed (partial reuse copies 15 rows of the tree's 4th page)
    assert exact["meta_info"]["cached_tokens"] == (63 if partial else 48)
    assert eng.cache_stats()["partial_page_hit_tokens"] == (5 + 15 if partial else 0)


def test_cache_stats_match_hand_count(tiny_model_dir: Path, make_engine) -> None:
    """A scripted workload whose hits are known: A, A, A+tail, B, then B's prefix with another tail."""
    eng = make_engine(tiny_model_dir, page_size=8, max_total_tokens=2048, enable_partial_page_reuse=False)
    rng = random.Random(2)
    a, b = rand_ids(rng, 35), rand_ids(rng, 20)
    script = [(a, 0), (a, 32), (a + rand_ids(rng, 10), 32), (b, 0), (b[:17] + rand_ids(rng, 9), 16)]
    for ids, hit in script:
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert out["meta_info"]["cached_tokens"] == hit
    stats = eng.cache_stats()
    prompt_tokens = sum(len(ids) for ids, _ in script)
    hits = sum(h for _, h in script)
    assert stats["prompt_tokens"] == prompt_tokens and stats["hit_tokens"] == hits
    assert stats["hit_rate"] == pytest.approx(hits / prompt_tokens)


def test_memory_pressure_evicts_then_retracts_and_outputs_stay_the_same(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(3)
    prompts = [rand_ids(rng, 40) for _ in range(6)]
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    alone_eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=4096)
    alone = [alone_eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]

    # 20 pages of 16 tokens; the six requests need 6 x 100 tokens. A low decode reservation over-admits on purpose.
    # Speculation (auto, on) must not change that: drafts take only the pages admission left (no draft reservation).
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=320, init_new_token_ratio=0.05)
    junk = rand_ids(rng, 200)
    eng.generate(input_ids=junk, sampling_params={"max_new_tokens": 1})
    stats = eng.cache_stats()
    assert (stats["cached_pages"], stats["partial_pages"]) == (13, 1)  # 12 full pages, the partial one kept
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == alone
    m = eng.metrics()
    assert m["num_retractions"] > 0
    again = eng.generate(input_ids=junk, sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] < 192, "the junk prefix should have been evicted"


def test_request_that_can_never_fit_fails_clearly(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=320)
    with pytest.raises(ValueError, match="cannot fit in the KV pool"):
        eng.generate(input_ids=list(range(3, 403)), sampling_params={"max_new_tokens": 4})
    with pytest.raises(ValueError, match="context length"):
        eng.generate(input_ids=[5] * 1000, sampling_params={"max_new_tokens": 100})
    with pytest.raises(ValueError, match="temperature"):
        eng.generate("hi", sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="empty"):
        eng.generate(input_ids=[], sampling_params=GREEDY)
    ok = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)  # still serving
    assert len(ok["output_ids"]) == 8


async def test_abort_at_random_moments_leaks_nothing(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(
        tiny_model_dir, page_size=4, max_total_tokens=1024, chunked_prefill_size=16, max_running_requests=3
    )
    rng = random.Random(4)

    async def abort_by_rid(ids: list[int], delay: float, rid: str) -> None:
        out = await abort_after(eng, ids, delay, rid)
        assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length", "stop")

    jobs = []
    for i in range(12):
        ids = rand_ids(rng, rng.choice([5, 40, 120]))
        if i % 2:
            jobs.append(leave_stream_after(eng, ids, rng.randrange(1, 6)))
        else:  # queued (max_running_requests=3), mid-prefill (chunks of 16) or mid-decode, depending on timing
            jobs.append(abort_by_rid(ids, rng.random() * 0.05, f"r{i}"))
    await asyncio.gather(*jobs)
    await asyncio.to_thread(wait_idle, eng)
    eng.check_invariants()


def test_same_seed_same_tokens_alone_and_in_a_busy_batch(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=4096)
    rng = random.Random(5)
    prompt = rand_ids(rng, 30)
    seeded = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    alone = eng.generate(input_ids=prompt, sampling_params=seeded)["output_ids"]
    others = [rand_ids(rng, rng.randrange(5, 60)) for _ in range(5)]
    batch = eng.generate(
        input_ids=others[:3] + [prompt] + others[3:],
        sampling_params=[{"max_new_tokens": 16, "temperature": 1.3, "ignore_eos": True}] * 3
        + [seeded]
        + [{"max_new_tokens": 16, "temperature": 0.7, "ignore_eos": True}] * 2,
    )
    assert batch[3]["output_ids"] == alone
    greedy = eng.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    top1 = eng.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0.8, "top_k": 1, "ignore_eos": True}
    )
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_token_ids_and_stop_strings(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    prompt = rand_ids(random.Random(6), 25)
    full = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    ids, text = full["output_ids"], full["text"]
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    out = eng.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_tok]},
    )
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # A stop string taken from the middle of the text: output ends right before its first occurrence.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = eng.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    )
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_namespaces_never_share_pages(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    prompt = rand_ids(random.Random(8), 50)
    a1 = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="tenant-a")
    b1 = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="tenant-b")
    a2 = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="tenant-a")
    plain = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert (a1["meta_info"]["cached_tokens"], b1["meta_info"]["cached_tokens"]) == (0, 0)
    # 3 full pages and (partial-page reuse) a1's partial page up to the last prompt token, which is always computed
    assert a2["meta_info"]["cached_tokens"] == 49 and plain["meta_info"]["cached_tokens"] == 0
    stats = eng.cache_stats()
    assert stats["partial_page_hit_tokens"] == 1  # only a2's copy: partial pages never cross namespaces either
    # one copy of the 3 full pages per namespace, and one partial page each (a2's equals a1's, which is kept)
    assert (stats["cached_pages"], stats["partial_pages"]) == (3 * 3 + 3, 3)


def test_n_samples_share_the_prompt_pages(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    prompt = rand_ids(random.Random(9), 64)
    outs = eng.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 8, "temperature": 1.0, "n": 4, "seed": 7, "ignore_eos": True},
    )
    assert len(outs) == 4
    # 3 full pages, and 15 rows copied from the 4th (the last token is computed for each sample's logits)
    assert all(o["meta_info"]["cached_tokens"] == 63 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert eng.metrics()["computed_prefill_tokens_total"] == 64 + 4 * 1


async def test_streaming_chunks_add_up(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = await eng.async_generate("hello world, 你好 🌍", sampling_params=params)
    chunks = [c async for c in eng.async_generate("hello world, 你好 🌍", sampling_params=params, stream=True)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_chat_encode_decode_and_prefill_only(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    ids = eng.apply_chat_template(msgs)
    assert eng.decode(ids).startswith("<|im_start|>system") is False  # special tokens are skipped when decoding
    assert eng.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system")
    out = eng.chat(msgs, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    pre = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert pre["output_ids"] == [] and pre["meta_info"]["finish_reason"]["type"] == "length"
    assert eng.encode("abc") == eng.tokenizer.encode("abc")


@pytest.mark.parametrize("limit", [None, 24])
def test_prefill_merge_limit_runs_long_prefills_one_per_step(tiny_model_dir: Path, make_engine, limit) -> None:
    """With a limit, a prefill chunk longer than it joins no step that holds other prefill work (shorter chunks may
    join it); without, all four prompts prefill in one step. Tokens are the same either way."""
    eng = make_engine(
        tiny_model_dir, page_size=4, max_total_tokens=4096, chunked_prefill_size=512, prefill_merge_tokens=limit
    )
    steps: list[list[int]] = []
    execute = eng.runner.execute

    def recording(batch):  # prefill chunks and decodes; a decode verifying a draft counts as a decode
        drafts = batch.drafts or [None] * len(batch.chunks)
        steps.append([c if d is None else 1 for c, d in zip(batch.chunks, drafts)])
        return execute(batch)

    eng.runner.execute = recording
    rng = random.Random(11)
    prompts = [rand_ids(rng, n) for n in (60, 40, 10, 50)]  # three long, one short enough to join any step
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    prefill_steps = [[c for c in chunks if c > 1] for chunks in steps if any(c > 1 for c in chunks)]
    if limit is None:
        assert prefill_steps == [[60, 40, 10, 50]]
    else:  # the 40 and the 50 wait for steps of their own; the 10 joins the first
        assert prefill_steps == [[60, 10], [40], [50]]
    reference = [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert [o["output_ids"] for o in outs] == reference


def test_a_batch_reaches_the_scheduler_whole(tiny_model_dir: Path, make_engine, monkeypatch) -> None:
    """A list of prompts is queued in one message, so its first step prefills them all even when building each
    request is slow: the steps a batch gets (and, without deterministic mode, its bits) do not depend on when the
    loop thread woke (radixserve/engine_requests.py, _submit_all)."""
    eng = make_engine(tiny_model_dir, speculative="off", deterministic=False)
    build = eng.inputs.make_req

    def slow(*args, **kwargs):
        time.sleep(0.05)  # the loop thread would take the requests queued so far meanwhile
        return build(*args, **kwargs)

    steps: list[list[int]] = []
    forward = eng.runner.forward

    def recorded(batch):
        steps.append(batch.extend_lens.tolist())
        return forward(batch)

    monkeypatch.setattr(eng.inputs, "make_req", slow)
    monkeypatch.setattr(eng.runner, "forward", recorded)
    prompts = [[10 + i, 20, 30, 40, 50] for i in range(4)]
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert steps[0] == [5, 5, 5, 5]


def test_run_all_and_stream_all_answer_as_their_calls_do(tiny_model_dir: Path, make_engine) -> None:
    from radixserve.errors import ParamError
    from radixserve.io import GenerateRequest

    eng = make_engine(tiny_model_dir, speculative="off")
    g = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    batch, twice = [[5, 6, 7], [8, 9]], {**g, "n": 2}
    want = [[o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=g, cache_salt="a")]]
    want.append([o["output_ids"] for o in eng.generate(input_ids=[4, 4, 4], sampling_params=twice, cache_salt="a")])
    calls = [
        GenerateRequest(input_ids=batch, sampling_params=g),
        GenerateRequest(input_ids=[4, 4, 4], sampling_params=twice),
    ]
    got = asyncio.run(eng.run_all(calls))
    assert [[o.output_ids for o in outs] for outs in got] == want

    async def streamed() -> list[list[int]]:
        out = []
        for s in eng.stream_all([GenerateRequest(input_ids=ids, sampling_params=g) for ids in batch]):
            out.append([t async for chunk in s for t in chunk.output_ids])
        return out

    assert asyncio.run(streamed()) == want[0]
    with pytest.raises(ParamError):  # a stream takes one prompt: refused before anything is queued
        asyncio.run(
            _stream_all_of(eng, [GenerateRequest(input_ids=[5], sampling_params=g), GenerateRequest(input_ids=batch)])
        )
    wait_idle(eng)


async def _stream_all_of(eng, calls):
    return eng.stream_all(calls)
