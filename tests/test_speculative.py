"""Speculative decoding (issue 16): the same greedy tokens with it on and off (every tiny architecture, cache hits,
chunked prefill, memory pressure, aborts, stops, penalties, logprobs), seeds unchanged, drafts that actually run,
and pool invariants after each (make_engine checks them at rest, DESIGN.md rule 2)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_checks import wait_idle
from tiny_models import ARCHS

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def copy_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts with text to copy (a repeated passage) and without, of several lengths."""
    passage = rand_ids(rng, 48)
    return [
        passage + rand_ids(rng, 5) + passage[:12],
        passage * 2,
        rand_ids(rng, 30),
        rand_ids(rng, 5),
        rand_ids(rng, 20) * 3 + rand_ids(rng, 3),
    ]


def greedy_both(
    make_engine: Callable, model: Path, prompts: list[list[int]], params: dict | None = None, **kw: object
) -> tuple[list[list[int]], list[list[int]], dict]:
    """Outputs with speculation off, then on (twice: the second round hits the cache); the on engine's stats."""
    params = params or GREEDY
    off = make_engine(model, speculative="off", **kw)
    want = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=params)]
    on = make_engine(model, speculative="ngram", **kw)
    got = [o["output_ids"] for o in on.generate(input_ids=prompts, sampling_params=params)]
    again = [o["output_ids"] for o in on.generate(input_ids=prompts, sampling_params=params)]
    assert again == got
    on.check_invariants()
    return want, got, on.cache_stats()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "config",
    [
        dict(page_size=16, chunked_prefill_size=512),
        dict(page_size=1, chunked_prefill_size=32),
        dict(page_size=4, chunked_prefill_size=24, enable_radix_cache=False),
    ],
    ids=["page16", "page1-chunk32", "page4-chunk24-nocache"],
)
def test_greedy_identical_with_speculation(arch: str, config: dict, tiny_model_factory, make_engine) -> None:
    prompts = copy_prompts(random.Random(len(arch)))
    want, got, stats = greedy_both(make_engine, tiny_model_factory(arch), prompts, max_total_tokens=4096, **config)
    assert got == want
    assert stats["spec_verify_steps"] > 0 and sum(stats["spec_accepted_tokens"].values()) > 0, stats
    if config.get("enable_radix_cache", True):
        assert stats["hit_tokens"] > 0  # the second round came from the cache


def test_memory_pressure_retraction_with_drafts(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(3)
    prompts = [p[:40] for p in copy_prompts(rng) * 2 if len(p) >= 20]
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    alone = make_engine(tiny_model_dir, speculative="off", max_total_tokens=4096)
    want = [alone.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    # 20 pages of 16 tokens for requests of ~100 tokens each: drafts compete for pages with retractions.
    eng = make_engine(
        tiny_model_dir, speculative="ngram", page_size=16, max_total_tokens=320, init_new_token_ratio=0.05
    )
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    m = eng.metrics()
    assert m["num_retractions"] > 0 and m["spec_verify_steps"] > 0, m
    eng.check_invariants()


async def test_aborts_mid_verify_leak_nothing(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(
        tiny_model_dir,
        speculative="ngram",
        page_size=4,
        max_total_tokens=1024,
        chunked_prefill_size=16,
        max_running_requests=3,
    )
    rng = random.Random(4)

    async def abort_later(ids: list[int], delay: float, rid: str) -> None:
        task = asyncio.ensure_future(
            eng.async_generate(
                input_ids=ids, rid=rid, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
            )
        )
        await asyncio.sleep(delay)
        eng.abort(rid)
        out = await task
        assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length")

    prompts = copy_prompts(rng) * 2
    await asyncio.gather(*(abort_later(p, rng.random() * 0.4, f"r{i}") for i, p in enumerate(prompts)))
    await asyncio.to_thread(wait_idle, eng)
    eng.check_invariants()
    assert eng.cache_stats()["spec_verify_steps"] > 0


def test_stops_inside_an_accepted_run_cut_there(tiny_model_dir: Path, make_engine) -> None:
    prompt = copy_prompts(random.Random(1))[1]
    off = make_engine(tiny_model_dir, speculative="off")
    on = make_engine(tiny_model_dir, speculative="ngram")
    full = off.generate(input_ids=prompt, sampling_params=GREEDY)
    ids = full["output_ids"]
    stop_id = ids[len(ids) // 2]  # some token well inside the answer, where drafts run
    stop_text = off.decode(ids[5:7])
    for extra in ({"stop_token_ids": [stop_id]}, {"stop": [stop_text]}, {"max_new_tokens": 13}):
        params = {**GREEDY, **extra}
        want, got = (e.generate(input_ids=prompt, sampling_params=params) for e in (off, on))
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], extra
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert on.cache_stats()["spec_verify_steps"] > 0


def test_penalties_logprobs_and_seeds_hold(tiny_model_dir: Path, make_engine) -> None:
    prompts = copy_prompts(random.Random(2))[:3]
    off = make_engine(tiny_model_dir, speculative="off")
    on = make_engine(tiny_model_dir, speculative="ngram")
    cases = [
        ({**GREEDY, "repetition_penalty": 1.3}, {}),
        ({**GREEDY, "frequency_penalty": 0.5, "presence_penalty": 0.3}, {}),
        (GREEDY, {"return_logprob": True, "top_logprobs_num": 3}),
        # a seeded sampled request never drafts, so its seed gives the same tokens as without speculation
        ({"max_new_tokens": 30, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}, {}),
    ]
    for params, kw in cases:
        want, got = (e.generate(input_ids=prompts, sampling_params=params, **kw) for e in (off, on))
        for w, g in zip(want, got):
            assert g["output_ids"] == w["output_ids"], params
            if kw:
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    a, b = w["meta_info"][key], g["meta_info"][key]
                    assert len(a) == len(b)
                    flat_a = [x for row in a for x in (row if key.endswith("top_logprobs") else [row])]
                    flat_b = [x for row in b for x in (row if key.endswith("top_logprobs") else [row])]
                    assert [t for _, t in flat_a] == [t for _, t in flat_b]
                    assert all(abs(x - y) < 1e-4 for (x, _), (y, _) in zip(flat_a, flat_b))
    assert on.cache_stats()["spec_verify_steps"] > 0


def test_auto_mode_and_overlap(tiny_model_dir: Path, make_engine) -> None:
    from radixserve.errors import ParamError

    eng = make_engine(tiny_model_dir)  # CPU: auto turns it on, overlap off
    assert eng.model_info()["speculative"].startswith("auto: on") and not eng.overlap_schedule
    assert make_engine(tiny_model_dir, overlap_schedule=True).cache_stats()["spec_enabled"] is False
    with pytest.raises(ParamError) as err:
        make_engine(tiny_model_dir, speculative="ngram", overlap_schedule=True)
    assert err.value.field == "speculative"
    with pytest.raises(ParamError):
        make_engine(tiny_model_dir, speculative="on")


def test_tree_drafts_then_invalidated_by_flush(tiny_model_dir: Path, make_engine) -> None:
    """A second request that continues an earlier one (its prompt and the start of its answer) drafts the rest of the
    answer from the tree (same tokens as without speculation); once the tree is flushed, no draft comes from it."""
    rng = random.Random(9)
    first = rand_ids(rng, 40)
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    off = make_engine(tiny_model_dir, speculative="off")
    on = make_engine(tiny_model_dir, speculative="ngram")
    answer = on.generate(input_ids=first, sampling_params=params)["output_ids"]
    assert answer == off.generate(input_ids=first, sampling_params=params)["output_ids"]
    second = first + answer[:4]
    want = off.generate(input_ids=second, sampling_params=params)["output_ids"]
    assert on.generate(input_ids=second, sampling_params=params)["output_ids"] == want
    stats = on.cache_stats()
    assert stats["spec_draft_tokens"]["tree"] > 0 and stats["spec_accepted_tokens"]["tree"] > 0, stats
    on.check_invariants()  # includes: the continuation index holds exactly the tree's pages
    assert on.flush_cache()
    assert on.generate(input_ids=second, sampling_params=params)["output_ids"] == want
    assert on.cache_stats()["spec_draft_tokens"]["tree"] == stats["spec_draft_tokens"]["tree"]


def test_metrics_count_drafts_per_source(tiny_model_dir: Path, make_engine) -> None:
    from radixserve.server.metrics import ServerMetrics

    eng = make_engine(tiny_model_dir, speculative="ngram")
    eng.generate(input_ids=copy_prompts(random.Random(5))[1], sampling_params=GREEDY)
    stats = eng.cache_stats()
    proposed, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert 0 < sum(accepted.values()) <= sum(proposed.values())
    assert sum(stats["spec_accepted_length_hist"]) == stats["spec_verify_steps"]
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + sum(accepted.values()) / stats["spec_verify_steps"])
    text = ServerMetrics(eng).render().decode()
    assert f'radixserve_spec_draft_tokens_total{{source="prompt"}} {float(proposed["prompt"])}' in text
    assert f'radixserve_spec_accepted_tokens_total{{source="tree"}} {float(accepted["tree"])}' in text
    assert f"radixserve_spec_accepted_drafts_per_step_count {float(stats['spec_verify_steps'])}" in text
