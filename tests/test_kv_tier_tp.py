"""The host and disk tiers under `--tp 2` (radixserve/tp_pool.py): rank 0 decides, every rank spills and loads its
own heads' shard of the same pages, and the files hold whole pages. Greedy outputs equal a single rank's without
tiers under heavy eviction; a restart hits with a fresh tensor-parallel server's output; damaged files are misses;
a directory written at tp 1 serves tp 2. Tiny model as in test_kv_tier_engine.py (float32, 2 KV heads)."""

from __future__ import annotations

from pathlib import Path

from test_kv_tier_engine import POOL, prompts, run, stop

HOST_GB = 40 * 3072 / (1 << 30)  # 40 pages of 3 layers x 4 tokens x 2 KV heads x 16 x K,V x float32


def test_tp2_tiers_under_heavy_eviction_give_one_ranks_tokens(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    ids = prompts()  # 6 x 64 tokens: 96 pages of KV for a pool of 24
    one = make_engine(tiny_model_dir, **POOL)
    want = [run(one, ids), run(one, ids)]
    tp2 = make_engine(tiny_model_dir, tp=2, kv_cache_dir=tmp_path, kv_cache_host_gb=HOST_GB, **POOL)
    assert [run(tp2, ids), run(tp2, ids)] == want
    s = tp2.cache_stats()
    assert s["host_hit_tokens"] > 0 and s["host_spilled_pages"] > 0, s  # (disk hits: the restart test below)
    tp2.check_invariants()


def test_tp2_restart_hits_with_a_fresh_servers_output_and_damage_is_a_miss(
    make_engine, tiny_model_dir, tmp_path: Path
) -> None:
    ids = prompts(2)
    cold = make_engine(tiny_model_dir, tp=2, **POOL)
    fresh = run(cold, ids)
    stop(cold)  # one tensor-parallel engine per process at a time
    first = make_engine(tiny_model_dir, tp=2, kv_cache_dir=tmp_path, **POOL)
    assert run(first, ids) == fresh
    stop(first)
    second = make_engine(tiny_model_dir, tp=2, kv_cache_dir=tmp_path, **POOL)
    assert second.cache_stats()["disk_pages"] >= 15
    assert run(second, ids) == fresh
    s = second.cache_stats()
    assert s["disk_hit_tokens"] >= 60 and s["loaded_pages"] > 0, s
    stop(second)
    for f in tmp_path.glob("*/*.kv"):  # every page file damaged: each one met is a miss, never served
        data = f.read_bytes()
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    third = make_engine(tiny_model_dir, tp=2, kv_cache_dir=tmp_path, **POOL)
    assert run(third, ids) == fresh
    s = third.cache_stats()
    assert s["disk_hit_tokens"] == 0 and s["loaded_pages"] == 0 and s["disk_bad_files"] > 0, s


def test_a_directory_written_at_tp1_serves_tp2(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    """The files hold whole pages in one rank's layout, so the tensor-parallel degree is not part of their key."""
    ids = prompts(1)
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    cold = run(first, ids)
    stop(first)
    second = make_engine(tiny_model_dir, tp=2, kv_cache_dir=tmp_path, **POOL)
    assert run(second, ids) == cold
    assert second.cache_stats()["disk_hit_tokens"] >= 60
