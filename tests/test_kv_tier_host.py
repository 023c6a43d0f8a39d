"""The host-RAM tier without a model, forced on for a CPU pool (on CUDA its buffer is pinned and its copies run on a
side stream; CI has no GPU, so this covers the tier's logic, not that path): round trips are bit-identical; the LRU
holds its limit and drops a prefix's tail first; pages leaving it cascade to the disk tier and load back from there;
a run larger than the whole tier goes on to disk; namespaces never meet and flush apart; a checkpoint writes the host
pages to disk. The tree's invariants hold after every scenario (DESIGN.md rule 3)."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.cache.disk_tier import DiskTier
from radixserve.cache.host_tier import HostTier, host_tier_bytes
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.kv_tier import KVTier
from radixserve.cache.radix_cache import RadixCache
from test_kv_tier import DIGEST, LAYOUT, PS, kv_of, put_prompt


def make(host_pages: int, disk: Path | None = None, num_pages: int = 16) -> tuple[KVPool, RadixCache, KVTier]:
    pool = KVPool(LAYOUT.num_layers, num_pages, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16)
    cache = RadixCache(pool, PS)
    store = DiskTier(disk, 1 << 30, DIGEST, LAYOUT.page_bytes) if disk is not None else None
    tier = KVTier(store, pool, LAYOUT, HostTier(host_pages * LAYOUT.page_bytes, LAYOUT, pool))
    cache.tier = tier
    return pool, cache, tier


def check(pool: KVPool, cache: RadixCache) -> None:
    cache.check_invariants()
    assert pool.num_free_pages + cache.total_pages == pool.capacity


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_round_trip_is_bit_identical_and_reloading_copies_nothing() -> None:
    pool, cache, tier = make(host_pages=8)
    assert not tier.host.buf.is_pinned()  # type: ignore[union-attr]  # a CPU pool: plain RAM
    tokens = list(range(100, 124))  # 6 pages
    before = kv_of(pool, put_prompt(pool, cache, tokens)).clone()
    assert cache.evict(cache.evictable_pages) == 6 and pool.num_free_pages == pool.capacity
    assert tier.host.num_pages == 6 and tier.host_stats.spilled_pages == 6  # type: ignore[union-attr]
    assert tier.load_prefix(cache, tokens + [1], "") == 6
    m = cache.match_prefix(tokens + [1])
    assert m.num_tokens == 24 and same(kv_of(pool, m.pages), before)
    snap = tier.snapshot()
    assert snap["host_loaded_pages"] == 6 and snap["host_hit_tokens"] == 24 and snap["loaded_pages"] == 0
    assert snap["host_bytes"] == 6 * LAYOUT.page_bytes and snap["host_load_seconds"] > 0
    check(pool, cache)
    cache.evict(cache.evictable_pages)  # the tier is inclusive: evicting again copies nothing
    assert tier.host_stats.spilled_pages == 6
    check(pool, cache)


def test_lru_holds_the_limit_and_drops_tails_first() -> None:
    pool, cache, tier = make(host_pages=6)
    prompts = [list(range(i * 100, i * 100 + 16)) for i in range(3)]  # 4 pages each, 12 for a tier of 6
    for p in prompts:
        put_prompt(pool, cache, p)
        cache.evict(cache.evictable_pages)
        assert tier.host.num_pages <= 6  # type: ignore[union-attr]
    assert tier.host.stats.lru_evicted_pages == 6  # type: ignore[union-attr]
    assert [tier.load_prefix(cache, p + [1], "") for p in prompts] == [0, 2, 4]  # oldest gone, the middle's head kept
    check(pool, cache)


def test_host_lru_cascades_to_disk_and_a_load_reads_both(tmp_path: Path) -> None:
    pool, cache, tier = make(host_pages=4, disk=tmp_path)
    a, b = list(range(16)), list(range(50, 66))
    kv_a = kv_of(pool, put_prompt(pool, cache, a)).clone()
    cache.evict(cache.evictable_pages)
    assert tier.store.num_pages == 0  # type: ignore[union-attr]  # write-back: disk only when the host lets go
    kv_b = kv_of(pool, put_prompt(pool, cache, b)).clone()
    cache.evict(cache.evictable_pages)  # a's 4 pages make room: they go on to disk
    assert tier.store.num_pages == 4 and tier.stats.spilled_pages == 4  # type: ignore[union-attr]
    assert tier.load_prefix(cache, a + [1], "") == 4 and tier.stats.loaded_pages == 4  # from disk
    assert tier.load_prefix(cache, b + [1], "") == 4 and tier.host_stats.loaded_pages == 4  # from host
    assert same(kv_of(pool, cache.match_prefix(a + [1]).pages), kv_a)
    assert same(kv_of(pool, cache.match_prefix(b + [1]).pages), kv_b)
    check(pool, cache)


def test_a_run_longer_than_the_host_tier_goes_on_to_disk_and_loads_from_both(tmp_path: Path) -> None:
    pool, cache, tier = make(host_pages=4, disk=tmp_path)
    tokens = list(range(300, 324))  # 6 pages
    before = kv_of(pool, put_prompt(pool, cache, tokens)).clone()
    cache.evict(cache.evictable_pages)
    assert tier.host.num_pages == 4 and tier.store.num_pages == 2  # type: ignore[union-attr]  # head in RAM
    assert tier.load_prefix(cache, tokens + [1], "") == 6
    assert tier.host_stats.loaded_pages == 4 and tier.stats.loaded_pages == 2
    assert same(kv_of(pool, cache.match_prefix(tokens + [1]).pages), before)
    check(pool, cache)


def test_namespaces_never_meet_and_flush_apart(tmp_path: Path) -> None:
    pool, cache, tier = make(host_pages=4, disk=tmp_path)
    tokens = list(range(16))
    for ns in ("tenant-a", "tenant-a|salt", "tenant-b"):  # 12 pages: the first 8 cascade to disk
        put_prompt(pool, cache, tokens, namespace=ns)
        cache.evict(cache.evictable_pages)
    assert tier.load_prefix(cache, tokens + [1], "") == 0
    assert tier.drop_namespaces(lambda ns: ns == "tenant-a" or ns.startswith("tenant-a|")) == 8
    assert {e.namespace for e in tier.store.index.values()} == set()  # type: ignore[union-attr]
    assert {e.namespace for _, e in tier.host.items()} == {"tenant-b"}  # type: ignore[union-attr]
    assert tier.load_prefix(cache, tokens + [1], "tenant-a") == 0
    assert tier.load_prefix(cache, tokens + [1], "tenant-b") == 4
    check(pool, cache)


def test_a_checkpoint_writes_the_host_pages_to_disk(tmp_path: Path) -> None:
    pool, cache, tier = make(host_pages=8, disk=tmp_path)
    tokens = list(range(500, 516))
    before = kv_of(pool, put_prompt(pool, cache, tokens)).clone()
    cache.evict(cache.evictable_pages)
    assert tier.store.num_pages == 0  # type: ignore[union-attr]
    tier.close(cache)  # shutdown: the host tier would not survive the process
    assert tier.host.buf.numel() == 0 and tier.host.limit_bytes == 0 and tier.host.num_pages == 0  # type: ignore[union-attr]
    pool2 = KVPool(LAYOUT.num_layers, 16, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16)
    cache2 = RadixCache(pool2, PS)
    cache2.tier = KVTier(DiskTier(tmp_path, 1 << 30, DIGEST, LAYOUT.page_bytes), pool2, LAYOUT)
    assert cache2.tier.load_prefix(cache2, tokens + [1], "") == 4
    assert same(kv_of(pool2, cache2.match_prefix(tokens + [1]).pages), before)
    check(pool2, cache2)


def test_automatic_size_is_off_on_cpu_and_a_setting_forces_it() -> None:
    pool = KVPool(LAYOUT.num_layers, 16, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16)
    assert host_tier_bytes(None, pool, LAYOUT.page_bytes) == 0
    assert host_tier_bytes(0, pool, LAYOUT.page_bytes) == 0
    assert host_tier_bytes(0.5, pool, LAYOUT.page_bytes) == 1 << 29


# ---- in a running engine (tiny model, a pool of 24 pages of 4 tokens; see test_kv_tier_engine.py) -----------------
PAGE_BYTES = 2 * 3 * 4 * 2 * 16 * 4  # K and V, 3 layers, 4 tokens, 2 KV heads of 16, float32


def gb(pages: int) -> float:
    return pages * PAGE_BYTES / (1 << 30)


def test_greedy_outputs_identical_with_the_host_tier_on_and_off_under_heavy_eviction(
    make_engine, tiny_model_dir
) -> None:
    from test_kv_tier_engine import POOL, prompts, run

    on = make_engine(tiny_model_dir, kv_cache_host_gb=gb(200), **POOL)
    off = make_engine(tiny_model_dir, kv_cache_host_gb=0, **POOL)
    ids = prompts()  # 6 x 64 tokens: 96 pages of KV for a pool of 24
    for _ in range(2):
        assert run(on, ids) == run(off, ids)
        on.check_invariants()
    s_on, s_off = on.cache_stats(), off.cache_stats()
    assert s_on["host_tier_enabled"] and not s_off["host_tier_enabled"] and not s_on["kv_cache_dir_enabled"]
    assert s_on["host_limit_bytes"] == 200 * PAGE_BYTES and s_on["host_pages"] > 24
    assert s_on["host_hit_tokens"] > 0 and s_on["host_loaded_pages"] > 0 and s_on["host_spilled_pages"] > 0
    assert s_on["hit_tokens"] == 5 * 40 + 6 * 60 > s_off["hit_tokens"], (s_on, s_off)  # the unlimited-pool optimum
    m = on.metrics()
    assert m["host_hit_tokens_total"] == s_on["host_hit_tokens"] and m["host_pages"] == s_on["host_pages"]


def test_a_small_host_tier_cascades_to_disk_with_identical_outputs(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    from test_kv_tier_engine import POOL, prompts, run

    both = make_engine(tiny_model_dir, kv_cache_host_gb=gb(20), kv_cache_dir=tmp_path, **POOL)
    off = make_engine(tiny_model_dir, kv_cache_host_gb=0, **POOL)
    ids = prompts()
    for order in (ids, ids[::-1]):  # backwards: the last prompts come from the pool and RAM, the first from disk
        assert run(both, order) == run(off, order)
    s = both.cache_stats()
    assert s["host_pages"] == 20 and s["host_lru_evicted_pages"] > 0 and s["disk_pages"] > 0
    assert s["host_hit_tokens"] > 0 and s["disk_hit_tokens"] > 0
    assert s["hit_tokens"] - s["partial_page_hit_tokens"] == 5 * 40 + 6 * 60  # the unlimited-pool optimum
    assert both.flush_cache()
    s = both.cache_stats()
    assert s["host_pages"] == s["disk_pages"] == s["cached_pages"] == 0
