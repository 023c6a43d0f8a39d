"""Rule 1 of DESIGN.md: greedy tokens equal HF transformers' (float32), cache on or off, for every architecture."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tiny_models import ARCHS

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    """Reference: transformers forward over the whole sequence each step, argmax (no KV cache involved)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(p) :])
    return outs


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def workload(rng: random.Random) -> dict[str, list[list[int]]]:
    shared = rand_ids(rng, 200)
    return {
        "single": [rand_ids(rng, 37)],
        "mixed": [rand_ids(rng, n) for n in (1, 5, 16, 17, 64, 130)],
        "shared_prefix": [shared + rand_ids(rng, rng.randrange(1, 40)) for _ in range(8)],
        "long": [rand_ids(rng, 150), rand_ids(rng, 109)],
    }


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]):
    model_dir = tiny_model_factory(request.param)
    prompts = workload(random.Random(hash(request.param) % 1000))
    flat = [p for ps in prompts.values() for p in ps]
    ref = dict(zip(map(tuple, flat), hf_greedy(model_dir, flat)))
    return model_dir, prompts, ref


CONFIGS = {
    "page16-cache": dict(page_size=16, enable_radix_cache=True, chunked_prefill_size=512),
    "page1-cache-chunk32": dict(page_size=1, enable_radix_cache=True, chunked_prefill_size=32),
    "page16-nocache-chunk32": dict(page_size=16, enable_radix_cache=False, chunked_prefill_size=32),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(arch_case, config: str, make_engine) -> None:
    model_dir, prompts, ref = arch_case
    eng = make_engine(model_dir, max_total_tokens=4096, **CONFIGS[config])
    for name in ("single", "mixed", "long"):
        outs = eng.generate(input_ids=prompts[name], sampling_params=GREEDY)
        for p, o in zip(prompts[name], outs):
            assert o["output_ids"] == ref[tuple(p)], f"{name}: prompt of {len(p)} tokens"
    # Shared prefix: all 8 at once (the scheduler staggers them onto one prefill), then again (all cached).
    for _ in range(2):
        outs = eng.generate(input_ids=prompts["shared_prefix"], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [ref[tuple(p)] for p in prompts["shared_prefix"]]
    eng.check_invariants()


def test_multi_turn_conversation_hits_cache_and_matches(tiny_model_factory, make_engine) -> None:
    model_dir = tiny_model_factory("llama3")
    rng = random.Random(7)
    eng = make_engine(model_dir, page_size=16, max_total_tokens=4096)
    history: list[int] = rand_ids(rng, 40)
    prompts, outs = [], []
    for turn in range(3):
        out = eng.generate(input_ids=history, sampling_params=GREEDY)
        prompts.append(list(history))
        outs.append(out["output_ids"])
        if turn > 0:  # all the previous turn computed came from the cache: full pages, then its partial page's rows
            prev_len = len(prompts[turn - 1]) + NEW  # (its last output token was sampled, never computed)
            assert out["meta_info"]["cached_tokens"] == prev_len - 1
        history = history + out["output_ids"] + rand_ids(rng, 20)
    assert outs == hf_greedy(model_dir, prompts)


def test_float32_logits_within_1e4_of_transformers(tiny_model_dir: Path, make_engine) -> None:
    """Prompt logprobs through the engine (cached prefix + computed tail) equal HF's log_softmax."""
    import transformers

    rng = random.Random(3)
    prompt = rand_ids(rng, 70)
    eng = make_engine(tiny_model_dir, page_size=16, max_total_tokens=2048)
    eng.generate(input_ids=prompt[:48] + [5], sampling_params={"max_new_tokens": 1})  # caches 3 pages of the prefix
    out = eng.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=40,
    )
    lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t in lps] == prompt[40:]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    expected = [float(ref[i - 1, prompt[i]]) for i in range(40, 70)]
    assert max(abs(a - b) for (a, _), b in zip(lps, expected)) < 1e-4
    # limited to the part before logprob_start_len - 1: 2 full pages and 7 rows of the 3rd (partial-page reuse)
    assert out["meta_info"]["cached_tokens"] == 39
