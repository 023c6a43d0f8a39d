"""Retention through the Engine (tiny model, a pool of 24 pages of 4 tokens): `retention_seconds` keeps a finished
request's prefix (prompt + output) through a flood that evicts a plain one, `Engine.retain` retains what a caller
names, bad values are refused before anything is queued, and each engine ends at rest (DESIGN.md rule 2)."""

from __future__ import annotations

import pytest

from radixserve.errors import ParamError

POOL = {"page_size": 4, "max_total_tokens": 96, "max_retained_share": 0.5, "max_retained_share_per_tenant": 0.5}
GREEDY = {"max_new_tokens": 5, "temperature": 0}
AGENT = list(range(300, 336))  # 36 tokens: 9 full pages; 10 with the 4 output tokens whose KV is computed


def flood(eng, rounds: int = 6) -> None:
    """Unrelated one-shot prompts that overflow the pool (6 x 10 pages through 24)."""
    for i in range(rounds):
        eng.generate(input_ids=[(13 * i + j) % 250 + 5 for j in range(36)], sampling_params=GREEDY)


def hit_tokens(eng, ids: list[int]) -> int:
    return eng.generate(input_ids=ids, sampling_params=GREEDY)["meta_info"]["cached_tokens"]


@pytest.mark.parametrize("retain", [False, True])
def test_retention_seconds_keeps_a_prefix_through_a_flood(make_engine, tiny_model_dir, retain: bool) -> None:
    eng = make_engine(tiny_model_dir, **POOL)
    extra = {"retention_seconds": 60, "retention_priority": 80} if retain else {}
    out = eng.generate(input_ids=AGENT, sampling_params=GREEDY, **extra)
    stats = eng.cache_stats()
    assert stats["retained_pages"] == (10 if retain else 0), "prompt + output: 40 tokens with KV, 10 full pages"
    assert stats["retained_bytes"] == (stats["device_bytes"] // stats["device_pages"] * 10 if retain else 0)
    flood(eng)
    eng.check_invariants()
    next_turn = AGENT + out["output_ids"] + [7, 8, 9]
    assert hit_tokens(eng, next_turn) == (40 if retain else 0)


def test_engine_retain_names_a_cached_prefix(make_engine, tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir, **POOL)
    out = eng.generate(input_ids=AGENT, sampling_params=GREEDY)
    assert eng.retain(AGENT + out["output_ids"], retention_seconds=30)
    assert not eng.retain(list(range(1, 20)), retention_seconds=30), "not cached: nothing to retain"
    assert eng.cache_stats()["retained_pages"] == 10
    eng.retain(AGENT, retention_seconds=30, wait=False)  # queued for the loop; the next call comes after it
    assert eng.cache_stats()["retentions"] == 2
    flood(eng)
    assert hit_tokens(eng, AGENT + out["output_ids"] + [7]) == 40


def test_retention_budget_refuses_past_the_tenant_share(make_engine, tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir, **{**POOL, "max_retained_share_per_tenant": 0.25})  # 6 pages per tenant
    eng.generate(input_ids=AGENT, sampling_params=GREEDY, retention_seconds=30, tenant="a")
    stats = eng.cache_stats()
    assert stats["retained_pages"] == 0 and stats["retentions_refused"] == 1
    eng.generate(input_ids=AGENT[:20], sampling_params=GREEDY, retention_seconds=30, tenant="a", cache_salt="s")
    assert eng.cache_stats()["retained_pages"] == 6, "20 + 4 tokens with KV: 6 pages fit the share"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"retention_seconds": 0}, "retention_seconds"),
        ({"retention_seconds": "5m"}, "retention_seconds"),
        ({"retention_seconds": 10**6}, "retention_seconds"),
        ({"retention_seconds": 5, "retention_priority": 0}, "retention_priority"),
        ({"retention_seconds": 5, "retention_priority": 2.5}, "retention_priority"),
    ],
)
def test_bad_retention_is_refused_before_queueing(make_engine, tiny_model_dir, kwargs: dict, field: str) -> None:
    eng = make_engine(tiny_model_dir, **POOL)
    with pytest.raises(ParamError) as err:
        eng.generate(input_ids=AGENT, sampling_params=GREEDY, **kwargs)
    assert err.value.field == field


def test_an_expired_retained_prefix_is_written_to_disk_before_it_leaves_the_pool(
    make_engine, tiny_model_dir, tmp_path
) -> None:
    import time

    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    out = eng.generate(input_ids=AGENT, sampling_params=GREEDY, retention_seconds=0.5)
    assert eng.cache_stats()["retained_pages"] == 10
    time.sleep(0.6)
    flood(eng)  # its retention ran out: evicted like any page, so spilled to the disk tier first
    stats = eng.cache_stats()
    assert stats["retained_pages"] == 0 and stats["retention_expired_nodes"] >= 1
    before = stats["disk_hit_tokens"]
    assert hit_tokens(eng, AGENT + out["output_ids"] + [7]) == 40
    assert eng.cache_stats()["disk_hit_tokens"] - before == 40, "served from the disk tier, not recomputed"
