"""The disk tier in a running engine (tiny model, a pool of 24 pages of 4 tokens): greedy outputs identical with the
tier on and off under heavy eviction; a restart hits with identical output; damaged files, another model or dtype,
and another namespace never hit; a second server on the directory is refused; disk errors degrade; flush clears
both tiers; pins survive eviction pressure within their share, and restarts within the share then; a namespace's
flush drops its pages in every tier and no other's. Every engine ends at rest (DESIGN.md rule 2)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from radixserve.cache import disk_tier as disk_tier_mod
from radixserve.cache.disk_tier import TierLockedError
from radixserve.errors import ParamError

POOL = {"page_size": 4, "max_total_tokens": 96}
GREEDY = {"max_new_tokens": 6, "temperature": 0}
SYSTEM = list(range(300, 340))  # 40 tokens shared by every prompt


def prompts(n: int = 6, doc: int = 24) -> list[list[int]]:
    return [SYSTEM + [(7 * i + j) % 500 + 3 for j in range(doc)] for i in range(n)]


def run(engine, ids: list[list[int]], salt: str = "") -> list[list[int]]:
    return [engine.generate(input_ids=x, sampling_params=GREEDY, cache_salt=salt)["output_ids"] for x in ids]


def stop(engine) -> None:
    """Shut down an engine the fixture will not check: check it here first."""
    engine.check_invariants()
    engine.shutdown()


def test_greedy_outputs_identical_with_the_tier_on_and_off_under_heavy_eviction(
    make_engine, tiny_model_dir, tmp_path: Path
) -> None:
    on = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    off = make_engine(tiny_model_dir, **POOL)
    ids = prompts()  # 6 x 64 tokens: 96 pages of KV for a pool of 24
    for _ in range(2):
        assert run(on, ids) == run(off, ids)
        on.check_invariants()
    batch = {"max_new_tokens": 6, "temperature": 0}
    outs_on = [o["output_ids"] for o in on.generate(input_ids=ids[:3], sampling_params=batch)]
    assert outs_on == [o["output_ids"] for o in off.generate(input_ids=ids[:3], sampling_params=batch)]
    s_on, s_off = on.cache_stats(), off.cache_stats()
    assert s_on["disk_hit_tokens"] > 0 and s_on["loaded_pages"] > 0 and s_on["spilled_pages"] > 0
    # The unlimited-pool optimum: the shared 40 tokens in round one, all 15 full pages of a 64-token prompt after.
    assert s_on["hit_tokens"] == 5 * 40 + 9 * 60 > s_off["hit_tokens"], (s_on, s_off)
    assert s_on["device_hit_tokens"] + s_on["disk_hit_tokens"] == s_on["hit_tokens"]
    m = on.metrics()
    assert m["disk_hit_tokens_total"] == s_on["disk_hit_tokens"] and m["disk_pages"] == s_on["disk_pages"]


def test_restart_hits_with_identical_output_and_namespaces_stay_apart(
    make_engine, tiny_model_dir, tmp_path: Path
) -> None:
    ids = prompts(2)
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    cold = run(first, ids, salt="tenant-a")
    stop(first)
    second = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    assert second.cache_stats()["disk_pages"] >= 15
    assert run(second, ids[:1], salt="tenant-b") == cold[:1]  # another namespace: computed, not loaded
    assert second.cache_stats()["hit_tokens"] == 0
    assert run(second, ids, salt="tenant-a") == cold
    s = second.cache_stats()
    assert s["disk_hit_tokens"] >= 60 and s["hit_tokens"] >= 60, s


@pytest.mark.parametrize("other", [{"seed": 1}, {"dtype": "bfloat16"}, {"page_size": 8}, {"kv_cache_dtype": "int8"}])
def test_a_different_model_or_setting_never_hits(
    make_engine, tiny_model_factory, tiny_model_dir, tmp_path: Path, other: dict
) -> None:
    ids = prompts(1)
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    run(first, ids)
    stop(first)
    model = tiny_model_factory("qwen2", seed=other["seed"]) if "seed" in other else tiny_model_dir
    settings = {**POOL, **{k: v for k, v in other.items() if k != "seed"}}
    second = make_engine(model, kv_cache_dir=tmp_path, **settings)
    assert second.cache_stats()["disk_pages"] == 0  # its own folder: the first one's pages are invisible to it
    run(second, ids)
    assert second.cache_stats()["hit_tokens"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_damaged_files_after_a_restart_are_misses(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    ids = prompts(1)
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    cold = run(first, ids)
    stop(first)
    pages = sorted(tmp_path.glob("*/*.kv"))
    for i, f in enumerate(pages):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if i % 2 else data[:-1] + bytes([data[-1] ^ 0xFF]))
    second = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    assert run(second, ids) == cold
    s = second.cache_stats()
    # Truncated files are caught at start (their size), flipped bits when read: each one met is deleted, none served.
    assert s["hit_tokens"] == 0 and s["disk_bad_files"] >= len(pages) // 2 and s["loaded_pages"] == 0
    second.check_invariants()


def test_a_second_server_on_the_directory_is_refused(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    with pytest.raises(TierLockedError, match="in use by another radixserve process"):
        make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_disk_errors_degrade_to_no_spilling(make_engine, tiny_model_dir, tmp_path: Path, monkeypatch, err: int) -> None:
    def fail(*args: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(disk_tier_mod.os, "replace", fail)
    on = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    off = make_engine(tiny_model_dir, **POOL)
    ids = prompts(4)
    assert run(on, ids) == run(off, ids)
    s = on.cache_stats()
    assert s["disk_write_errors"] == 1 and s["disk_pages"] == 0 and not s["disk_writable"]
    on.check_invariants()


def test_tiny_disk_limit_and_unusable_directory(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    tiny = make_engine(tiny_model_dir, kv_cache_dir=tmp_path / "kv", kv_cache_disk_gb=20e3 / (1 << 30), **POOL)
    ids = prompts(4)
    outs = run(tiny, ids)
    s = tiny.cache_stats()
    assert 0 < s["disk_bytes"] <= 20e3 and s["disk_lru_evicted_pages"] > 0
    (tmp_path / "file").write_text("not a directory")
    nowhere = make_engine(tiny_model_dir, kv_cache_dir=tmp_path / "file" / "kv", **POOL)  # mkdir fails
    assert not nowhere.cache_stats()["kv_cache_dir_enabled"]
    assert run(nowhere, ids) == outs


def test_flush_clears_both_tiers(make_engine, tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    run(eng, prompts(3))
    assert eng.cache_stats()["disk_pages"] > 0
    assert eng.flush_cache()
    s = eng.cache_stats()
    assert s["disk_pages"] == 0 and s["cached_pages"] == 0 and not list(tmp_path.glob("*/*.kv"))


def test_pin_keeps_a_prefix_through_eviction_within_its_share(make_engine, tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir, max_pinned_share=0.5, **POOL)  # at most 12 of 24 pages pinned
    pinned = SYSTEM + [5, 6, 7, 8]  # 44 tokens: 11 full pages
    assert eng.pin(input_ids=pinned) == {"pinned_tokens": 44, "prompt_tokens": 44}
    assert eng.pin(input_ids=pinned)["pinned_tokens"] == 44  # twice is once
    run(eng, [list(range(i * 40 + 1, i * 40 + 37)) for i in range(5)])  # unrelated prompts churn the pool
    eng.check_invariants()
    # A request that fits the pool but not beside the pins is refused at once instead of cycling forever.
    out = eng.generate(input_ids=list(range(200, 260)), sampling_params=GREEDY)
    assert "beside pinned prefixes" in out["meta_info"]["finish_reason"]["message"]
    assert eng.cache_stats()["pinned_pages"] == 11
    before = eng.cache_stats()["hit_tokens"]
    run(eng, [pinned + [9, 10, 11]])
    assert eng.cache_stats()["hit_tokens"] - before == 44
    with pytest.raises(ParamError, match="over the limit"):
        eng.pin(input_ids=list(range(400, 420)))  # 5 more pages: 16 > 12
    assert eng.pin(input_ids=SYSTEM[:4], cache_salt="other")["pinned_tokens"] == 4  # its own namespace: 12 fits
    assert eng.unpin(input_ids=pinned) and not eng.unpin(input_ids=pinned)
    eng.check_invariants()
    assert eng.cache_stats()["pinned_pages"] == 1


def test_an_idle_engine_checkpoints_its_tree_to_disk(make_engine, tiny_model_dir, tmp_path: Path, monkeypatch) -> None:
    import time

    from radixserve import engine_cache

    monkeypatch.setattr(engine_cache, "CHECKPOINT_S", 0.0)
    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    run(eng, prompts(1))  # 16 pages, all still in the pool: nothing was evicted
    deadline = time.monotonic() + 10

    def tree_pages() -> int:  # kept partial pages (issue 19) are outside the tree: the tier never holds them
        stats = eng.cache_stats()
        return stats["cached_pages"] - stats["partial_pages"]

    while eng.cache_stats()["disk_pages"] < tree_pages():
        assert time.monotonic() < deadline, eng.cache_stats()
        time.sleep(0.05)
    assert list(tmp_path.glob("*/index.json"))


def test_pins_survive_a_restart_within_the_share(make_engine, tiny_model_dir, tmp_path: Path, caplog) -> None:
    other = list(range(400, 408))  # 2 pages, in another namespace
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, max_pinned_share=0.5, **POOL)  # 12 of 24 pages
    first.pin(input_ids=list(range(200, 208)))
    assert first.unpin(input_ids=list(range(200, 208)))  # unpinned before the restart: not restored
    first.pin(input_ids=SYSTEM)  # 10 pages
    first.pin(input_ids=other, cache_salt="tenant-b")
    run(first, [list(range(i * 40 + 1, i * 40 + 37)) for i in range(4)])  # churn: the pins stay, the rest spills
    stop(first)
    second = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, max_pinned_share=0.5, **POOL)
    s = second.cache_stats()
    assert s["pinned_pages"] == 12 and s["loaded_pages"] == 12  # loaded from disk and pinned again at start
    run(second, [list(range(i * 40 + 1, i * 40 + 37)) for i in range(4)])
    before = second.cache_stats()["hit_tokens"]
    run(second, [SYSTEM + [9, 10, 11]])
    assert second.cache_stats()["hit_tokens"] - before == 40  # the pin held through the churn
    assert not second.unpin(input_ids=list(range(200, 208)))
    stop(second)
    # A smaller share at the next start: a pin that no longer fits is dropped with a warning, not an error.
    third = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, max_pinned_share=0.25, **POOL)  # 6 pages
    assert third.cache_stats()["pinned_pages"] == 2 and "not restored" in caplog.text
    stop(third)
    fourth = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, max_pinned_share=0.5, **POOL)
    assert fourth.cache_stats()["pinned_pages"] == 2  # the pin the third could not restore is gone from pins.json
    assert fourth.unpin(input_ids=other, cache_salt="tenant-b")


# With the host tier (30 pages, forced on the CPU) and n-gram speculation on, the tree's continuation index must
# forget the flushed pages too.
@pytest.mark.parametrize("host_gb,speculative", [(0, "off"), (30 * 3072 / (1 << 30), "ngram")])
def test_a_namespace_flush_drops_its_pages_in_every_tier(
    make_engine, tiny_model_dir, tmp_path: Path, host_gb: float, speculative: str
) -> None:
    ids = prompts(3)
    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, kv_cache_host_gb=host_gb, speculative=speculative, **POOL)
    for salt in ("tenant-b", "tenant-a|x", "tenant-a"):  # tenant-a last: its pages are in the pool too
        run(eng, ids, salt=salt)
    assert eng.cache_stats()["cached_pages"] > 0
    tier = eng.tier
    held = [e.namespace for e in tier.store.index.values()]
    if tier.host is not None:
        held += [e.namespace for _, e in tier.host.items()]
    assert {"tenant-a", "tenant-a|x", "tenant-b"} <= set(held)
    assert eng.flush_cache(lambda ns: ns == "tenant-a" or ns.startswith("tenant-a|")) >= held.count("tenant-a")
    eng.check_invariants()
    left = {e.namespace for e in tier.store.index.values()}
    if tier.host is not None:
        left |= {e.namespace for _, e in tier.host.items()}
    assert left == {"tenant-b"}
    assert len(list(tmp_path.glob("*/*.kv"))) == tier.store.num_pages
    stop(eng)
    again = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    assert run(again, ids[:1], salt="tenant-a") == run(again, ids[:1], salt="tenant-b")  # no cache_salt effect
    s = again.cache_stats()
    assert s["disk_hit_tokens"] == 60 and s["hit_tokens"] == 60, s  # tenant-b's pages came back, tenant-a's did not
