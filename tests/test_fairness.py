"""Scheduling between tenants and priorities: the fair-share order, a flood that cannot starve another tenant under
longest-prefix-first, a high priority retracting low-priority decodes (pool invariants after, outputs unchanged),
timeouts that abort and free, and the per-namespace flush of the radix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine_checks import wait_idle
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.scheduler.fairness import RECENT_STEPS, FairShare, by_priority_only

GREEDY = {"temperature": 0, "ignore_eos": True}


def fake(tenant: str, created: float, priority: int = 0, tokens: int = 100) -> Any:
    return SimpleNamespace(
        tenant=tenant, created=created, priority=priority, num_fill=tokens, kv_len=0, name=f"{tenant}{int(created)}"
    )


def names(reqs: list[Any]) -> list[str]:
    return [r.name for r in reqs]


def test_fair_order_interleaves_tenants_by_tokens_served() -> None:
    flood = [fake("A", t) for t in range(6)]
    quiet = [fake("B", 10)]
    fair = FairShare(512)
    assert names(fair.order(flood + quiet, list)) == ["A0", "B10", "A1", "A2", "A3", "A4", "A5"]
    assert names(by_priority_only(flood + quiet, list)) == ["A0", "A1", "A2", "A3", "A4", "A5", "B10"]
    fair.charge("A", 1000)  # A was served a lot: B goes first
    assert names(fair.order(flood + quiet, list))[:2] == ["B10", "A0"]
    # B leaves and comes back: it starts level with A, with no credit banked while away
    fair.order(flood, list)
    fair.charge("A", 5000)
    assert fair.served["A"] > 0 and "B" not in fair.served
    assert names(fair.order(flood + quiet, list))[:3] == ["A0", "B10", "A1"]


def test_priority_comes_before_fair_share() -> None:
    reqs = [fake("A", 0), fake("B", 1), fake("A", 2, priority=5), fake("B", 3, priority=-1)]
    assert names(FairShare(512).order(reqs, list)) == ["A2", "A0", "B1", "B3"]
    assert names(by_priority_only(reqs, list)) == ["A2", "A0", "B1", "B3"]


async def _finish_order(engine: Any, calls: list[dict], first: dict) -> list[str]:
    """Start `first` (it holds the only running slot), queue `calls`, return the rids in the order they finish."""
    order: list[str] = []

    async def run(kw: dict) -> dict:
        out = await engine.async_generate(**kw)
        order.append(kw["rid"])
        return out

    head = asyncio.ensure_future(run(first))
    while engine.metrics()["num_running"] == 0:
        await asyncio.sleep(0.005)
    outs = await asyncio.gather(*(run(kw) for kw in calls))
    await head
    assert all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in outs)
    return order


def test_a_flood_with_cached_prefixes_cannot_starve_another_tenant(tiny_model_dir: Path, make_engine: Callable) -> None:
    shared = list(range(10, 90))  # the flood's prompts share a cached prefix: longest-prefix-first favours them
    results = {}
    for fair in (True, False):
        eng = make_engine(tiny_model_dir, page_size=4, max_running_requests=1, schedule_policy="lpm", fair_share=fair)
        eng.generate(input_ids=shared + [1], sampling_params={**GREEDY, "max_new_tokens": 1}, tenant="A")
        flood = [
            dict(input_ids=shared + [2 + i], sampling_params={**GREEDY, "max_new_tokens": 2}, tenant="A", rid=f"A{i}")
            for i in range(6)
        ]
        quiet = dict(
            input_ids=list(range(200, 260)), sampling_params={**GREEDY, "max_new_tokens": 2}, tenant="B", rid="B"
        )
        first = dict(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 30}, tenant="A", rid="first")
        results[fair] = [r for r in asyncio.run(_finish_order(eng, flood + [quiet], first)) if r != "first"]
    assert results[True].index("B") <= 1, results[True]  # fair share: B's turn comes at once
    assert results[False][-1] == "B", results[False]  # off: behind the whole flood


def test_high_priority_retracts_low_priority_decodes(tiny_model_dir: Path, make_engine: Callable) -> None:
    eng = make_engine(tiny_model_dir, page_size=4, max_running_requests=1)
    low_kw = dict(input_ids=list(range(20, 40)), sampling_params={**GREEDY, "max_new_tokens": 120})
    alone = eng.generate(**low_kw)["output_ids"]

    async def scenario(priority: int) -> tuple[list[str], dict]:
        order: list[str] = []
        res: dict = {}

        async def run(name: str, **kw: Any) -> None:
            res[name] = await eng.async_generate(**kw)
            order.append(name)

        low = asyncio.ensure_future(run("low", **low_kw, priority=0))
        while eng.metrics()["generation_tokens_total"] < gen0 + 10:  # low is decoding
            await asyncio.sleep(0.005)
        await run("high", input_ids=[3, 4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 4}, priority=priority)
        await low
        return order, res

    gen0 = eng.metrics()["generation_tokens_total"]
    retractions = eng.metrics()["num_retractions"]
    order, res = asyncio.run(scenario(priority=10))
    assert order == ["high", "low"]
    assert eng.metrics()["num_retractions"] > retractions
    assert res["low"]["output_ids"] == alone  # retracted and resumed: the same tokens
    wait_idle(eng)
    eng.check_invariants()
    gen0 = eng.metrics()["generation_tokens_total"]
    order, _ = asyncio.run(scenario(priority=0))  # equal priority: no retraction, it waits its turn
    assert order == ["low", "high"]


def test_high_priority_takes_pages_from_low_priority(tiny_model_dir: Path, make_engine: Callable) -> None:
    # Full reservations (ratio 1): the two low-priority requests leave too few pages for the high one to fit
    # beside them, however the decaying ratio has moved by the time it arrives. Speculation off: accepted drafts
    # would let the low-priority requests finish before the high one can matter.
    eng = make_engine(
        tiny_model_dir,
        page_size=4,
        max_total_tokens=256,
        max_running_requests=8,
        init_new_token_ratio=1.0,
        speculative="off",
    )

    async def scenario() -> list[str]:
        order: list[str] = []

        async def run(name: str, **kw: Any) -> None:
            out = await eng.async_generate(**kw)
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            order.append(name)

        lows = [
            asyncio.ensure_future(
                run(f"low{i}", input_ids=list(range(30 + i, 60 + i)), sampling_params={**GREEDY, "max_new_tokens": 90})
            )
            for i in range(2)
        ]
        while eng.metrics()["generation_tokens_total"] < 20:
            await asyncio.sleep(0.005)
        await run("high", input_ids=list(range(100, 140)), sampling_params={**GREEDY, "max_new_tokens": 60}, priority=1)
        await asyncio.gather(*lows)
        return order

    order = asyncio.run(scenario())
    assert order[0] == "high", order
    assert eng.metrics()["num_retractions"] >= 1
    wait_idle(eng)
    eng.check_invariants()


def test_timeouts_abort_waiting_and_running_requests_and_free_their_pages(
    tiny_model_dir: Path, make_engine: Callable
) -> None:
    # Speculation off: the 1,000-token request must still be decoding when its timeout ends it (the tiny model
    # decodes ~1,500 tokens/s on a quiet 2-core machine, so 0.25 s leaves it far from done).
    eng = make_engine(tiny_model_dir, page_size=4, max_running_requests=1, speculative="off")

    async def scenario() -> tuple[dict, dict, dict]:
        running = eng.async_generate(
            input_ids=list(range(10, 30)), sampling_params={**GREEDY, "max_new_tokens": 1000}, timeout=0.25
        )
        waiting = eng.async_generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 2}, timeout=0.1)
        fine = eng.async_generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 2}, timeout=60)
        return tuple(await asyncio.gather(running, waiting, fine))  # type: ignore[return-value]

    running, waiting, fine = asyncio.run(scenario())
    for out in (running, waiting):
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "matched": None, "message": "timeout"}
    assert waiting["meta_info"]["completion_tokens"] == 0  # it never ran
    assert 0 < running["meta_info"]["completion_tokens"] < 1000  # stopped mid-decode
    assert fine["meta_info"]["finish_reason"]["type"] == "length"
    wait_idle(eng)
    eng.check_invariants()
    stats = eng.cache_stats()
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]


def test_flush_namespaces_drops_only_unlocked_pages_of_those_namespaces() -> None:
    pool = KVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool, 4)

    def put(tokens: list[int], ns: str) -> Any:
        pages = pool.alloc(len(tokens) // 4)
        assert pages is not None
        return cache.insert(tokens, pages, ns)

    toks = list(range(16))
    put(toks, "key-a")
    put(toks[:8] + [99] * 8, "key-a")  # a branch
    put(toks, "key-a|salt")
    put(toks, "key-b")
    locked = put(list(range(50, 58)), "key-a").node
    cache.lock(locked)
    before_b = cache.match_prefix(toks + [0], "key-b").num_tokens
    freed = cache.flush_namespaces(lambda ns: ns == "key-a" or ns.startswith("key-a|"))
    cache.check_invariants()
    assert freed == 4 + 2 + 4  # key-a's two branches and key-a|salt; the locked run stays
    assert cache.match_prefix(toks + [0], "key-a").num_tokens == 0
    assert cache.match_prefix(toks + [0], "key-a|salt").num_tokens == 0
    assert cache.match_prefix(list(range(50, 58)) + [0], "key-a").num_tokens == 8  # in use: kept
    assert cache.match_prefix(toks + [0], "key-b").num_tokens == before_b == 16
    cache.unlock(locked)
    assert cache.flush_namespaces(lambda ns: ns == "key-a") == 2
    cache.check_invariants()
    assert pool.num_free_pages + cache.total_pages == pool.capacity


def test_a_tenant_holding_every_slot_gives_one_up_to_another(tiny_model_dir: Path, make_engine: Callable) -> None:
    results = {}
    for fair in (True, False):
        eng = make_engine(tiny_model_dir, page_size=4, max_running_requests=3, fair_share=fair)

        async def scenario() -> list[str]:
            order: list[str] = []

            async def run(name: str, **kw: Any) -> None:
                out = await eng.async_generate(**kw)
                assert out["meta_info"]["finish_reason"]["type"] == "length"
                order.append(name)

            flood = [
                asyncio.ensure_future(
                    run(f"A{i}", input_ids=[7 + i, 8, 9], tenant="A", sampling_params={**GREEDY, "max_new_tokens": 150})
                )
                for i in range(3)
            ]
            while eng.metrics()["num_running"] < 3:
                await asyncio.sleep(0.005)
            await run("B", input_ids=[40, 41, 42], tenant="B", sampling_params={**GREEDY, "max_new_tokens": 4})
            await asyncio.gather(*flood)
            return order

        results[fair] = asyncio.run(scenario())
        wait_idle(eng)
        eng.check_invariants()
    assert results[True][0] == "B", results[True]  # it took a slot from A's flood at once
    assert results[False].index("B") >= 1, results[False]  # it waited for a slot


def test_a_tenant_alone_gets_whole_steps_and_shares_them_while_another_is_active() -> None:
    fair = FairShare(512)
    fair.begin_step(["A"])
    assert fair.room("A") == 512  # alone: the whole budget
    fair.begin_step(["A", "B"])
    fair.charge("A", 200)
    assert (fair.room("A"), fair.room("B")) == (56, 256)  # half each while both are active
    for _ in range(RECENT_STEPS - 1):
        fair.begin_step(["A"])  # B has gone: it still counts as active for a while
    assert fair.room("A") == 256
    fair.begin_step(["A"])
    assert fair.room("A") == 512
    tiny = FairShare(1)  # a budget too small to share: each tenant still gets its token per step
    tiny.begin_step(["A", "B"])
    assert (tiny.room("A"), tiny.room("B")) == (1, 1)


def prefill_per_tenant_per_step(eng: Any) -> list[dict[str, int]]:
    """Record, for every step the engine runs from now on, the prefill tokens of each tenant in it (a decode's single
    token does not count); the list fills as the steps run."""
    steps: list[dict[str, int]] = []
    execute = eng.runner.execute

    def logged(batch: Any) -> Any:
        tokens: dict[str, int] = {}
        for req, n in zip(batch.reqs, batch.chunks):
            tokens[req.tenant] = tokens.get(req.tenant, 0) + (n if n > 1 else 0)
        steps.append(tokens)
        return execute(batch)

    eng.runner.execute = logged
    return steps


def test_a_flood_takes_at_most_half_of_each_step_prefill_while_another_tenant_runs(
    tiny_model_dir: Path, make_engine: Callable
) -> None:
    """A request of another tenant arriving while a step runs waits for all of that step (steps cannot be
    interrupted): the flood's prefill in any step is at most half the budget while another tenant is active, so that
    wait and the flood's part of the step the newcomer joins are bounded. Before, the flood's admissions filled
    every step's budget (5 prompts of 24 tokens = 120 of 128)."""
    budget = 128
    # Speculation off: the step contents are what is checked, and verify steps would add draft rows to them.
    eng = make_engine(
        tiny_model_dir, page_size=4, max_running_requests=16, chunked_prefill_size=budget, speculative="off"
    )
    steps = prefill_per_tenant_per_step(eng)

    async def scenario() -> None:
        quiet = asyncio.ensure_future(
            eng.async_generate(input_ids=[5, 6, 7, 8], sampling_params={**GREEDY, "max_new_tokens": 150}, tenant="B")
        )
        while eng.metrics()["num_running"] == 0:
            await asyncio.sleep(0.005)
        flood = [  # distinct 24-token prompts: no cache hits, each short enough to merge with others
            eng.async_generate(
                input_ids=[(7 * i + k) % 500 + 3 for k in range(24)],
                sampling_params={**GREEDY, "max_new_tokens": 4},
                tenant="A",
            )
            for i in range(40)
        ]
        outs = await asyncio.gather(*flood)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert not quiet.done(), "B must run beside the whole flood for the check below to mean anything"
        await quiet

    asyncio.run(scenario())
    beside = [s.get("A", 0) for s in steps if "B" in s]  # the steps B ran in (it decodes in every step till done)
    assert sum(beside) == 40 * 24  # the whole flood's prefill ran beside B
    assert max(beside) <= budget // 2, beside


def test_another_tenant_prompt_joins_a_step_beside_the_flood_long_prefills(
    tiny_model_dir: Path, make_engine: Callable
) -> None:
    """A prompt too long to merge with other prefill work (over prefill_merge_tokens) used to wait for a step free
    of it: behind a flood of long prompts, until the running one had finished its prefill. With fair share on it
    joins the next step beside the flood's chunk (each tenant's part bounded by its room)."""
    # Speculation off: the step contents are what is checked, and verify steps would add draft rows to them.
    eng = make_engine(tiny_model_dir, page_size=4, max_running_requests=4, chunked_prefill_size=128, speculative="off")
    steps = prefill_per_tenant_per_step(eng)

    async def scenario() -> None:
        flood = [  # 3 x 900 distinct tokens, prefilled one after another in chunks (at most 64 beside B)
            asyncio.ensure_future(
                eng.async_generate(
                    input_ids=[(11 * i + 3 * k) % 500 + 3 for k in range(900)],
                    sampling_params={**GREEDY, "max_new_tokens": 2},
                    tenant="A",
                )
            )
            for i in range(3)
        ]
        while eng.metrics()["num_running"] == 0:  # the first of them is prefilling, the others wait their turn
            await asyncio.sleep(0.002)
        await eng.async_generate(
            input_ids=list(range(100, 140)), sampling_params={**GREEDY, "max_new_tokens": 1}, tenant="B"
        )
        assert not all(f.done() for f in flood)
        await asyncio.gather(*flood)

    asyncio.run(scenario())
    b_step = next(i for i, s in enumerate(steps) if s.get("B"))
    assert steps[b_step]["B"] == 40  # its whole prompt in one step
    # Beside the flood's prefill chunk (at most half the budget): before, B waited for the running flood request's
    # prefill to end (7 steps of 128 tokens here; with 4,000-token prompts, 8 steps of 512).
    assert 0 < steps[b_step].get("A", 0) <= 64, steps[b_step]
