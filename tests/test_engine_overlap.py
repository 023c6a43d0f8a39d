"""Overlapped scheduling (step N+1 scheduled while step N runs, tokens seen one step late) changes no result."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from engine_checks import wait_idle
from test_engine import rand_ids


def run_workload(eng) -> list:
    rng = random.Random(11)
    prompts = [rand_ids(rng, n) for n in (3, 17, 40, 90, 33, 64)]
    greedy = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
    results = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
    seeded = [
        {"max_new_tokens": 10, "temperature": 0.9, "top_k": 50, "seed": i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    results += [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=seeded)]
    # Penalties read the output history, so those batches run without overlap; mixed with others here.
    pen = [{"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.3, "ignore_eos": True}] * 3 + [greedy] * 3
    results += [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=pen)]
    # Stops decided one step late: a stop token and a length of 1.
    full = eng.generate(input_ids=prompts[2], sampling_params=greedy)["output_ids"]
    stop = eng.generate(input_ids=prompts[2], sampling_params={**greedy, "stop_token_ids": [full[3]]})
    results.append((stop["output_ids"], stop["meta_info"]["finish_reason"]))
    results.append(eng.generate(input_ids=prompts[0], sampling_params={**greedy, "max_new_tokens": 1})["output_ids"])
    lp = eng.generate(
        input_ids=prompts[3], sampling_params=greedy, return_logprob=True, logprob_start_len=50, top_logprobs_num=2
    )
    results.append([t for _, t in lp["meta_info"]["input_token_logprobs"]])
    results.append([t for _, t in lp["meta_info"]["output_token_logprobs"]])
    return results


def test_overlap_gives_the_same_tokens(tiny_model_dir: Path, make_engine) -> None:
    sync = make_engine(tiny_model_dir, page_size=4, max_total_tokens=4096, overlap_schedule=False)
    overlap = make_engine(tiny_model_dir, page_size=4, max_total_tokens=4096, overlap_schedule=True)
    assert run_workload(overlap) == run_workload(sync)
    overlap.check_invariants()


def test_overlap_under_memory_pressure_and_aborts(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(12)
    prompts = [rand_ids(rng, 40) for _ in range(6)]
    params = {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}
    ref = make_engine(tiny_model_dir, page_size=16, max_total_tokens=4096)
    alone = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    eng = make_engine(
        tiny_model_dir, page_size=16, max_total_tokens=320, init_new_token_ratio=0.05, overlap_schedule=True
    )
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == alone
    assert eng.metrics()["num_retractions"] > 0

    async def abort_some() -> None:
        async def one(i: int) -> None:
            it = eng.async_generate(input_ids=prompts[i % 6], sampling_params=params, stream=True)
            n = 0
            async for _ in it:
                n += 1
                if n > i:
                    break
            await it.aclose()

        await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(abort_some())
    wait_idle(eng)
    eng.check_invariants()
