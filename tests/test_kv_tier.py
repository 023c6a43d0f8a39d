"""The disk tier under the radix tree, without a model: a KVPool of random KV, a RadixCache, a DiskTier in tmp_path.

Round trips are bit-identical; damaged, foreign or other-namespace files are misses (and damaged ones deleted); the
size limit holds; a second process is refused; write errors turn spilling off without an exception; and the tree's
invariants hold after every scenario (DESIGN.md rule 3)."""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from radixserve.cache import disk_tier as disk_tier_mod
from radixserve.cache import kv_digest as kv_digest_mod
from radixserve.cache.disk_tier import DiskTier, TierLockedError
from radixserve.cache.kv_digest import KVLayout, kv_digest
from radixserve.cache.kv_format import KVFormat
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.kv_tier import KVTier, open_tier
from radixserve.cache.radix_cache import RadixCache

PS = 4
LAYOUT = KVLayout(
    num_layers=2,
    page_size=PS,
    num_kv_heads=2,
    head_dim=8,
    dtype="bfloat16",
    itemsize=2,
    kv_dtype="bfloat16",
    key_width=8,
    value_width=8,
    activations="bfloat16",
)
DIGEST = "a" * 32


def make(root: Path, num_pages: int = 16, limit: int = 1 << 30, digest: str = DIGEST) -> tuple[KVPool, RadixCache]:
    pool = KVPool(LAYOUT.num_layers, num_pages, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16)
    cache = RadixCache(pool, PS)
    cache.tier = KVTier(DiskTier(root, limit, digest, LAYOUT.page_bytes), pool, LAYOUT)
    return pool, cache


def put_prompt(pool: KVPool, cache: RadixCache, tokens: list[int], namespace: str = "") -> list[int]:
    """Cache `tokens` (full pages) with random KV; returns the pool pages."""
    pages = pool.alloc(len(tokens) // PS)
    assert pages is not None
    for kb, vb in zip(pool.k_buffers, pool.v_buffers):
        kb[pages] = torch.randn(len(pages), *kb.shape[1:]).to(kb.dtype)
        vb[pages] = torch.randn(len(pages), *vb.shape[1:]).to(vb.dtype)
    cache.insert(tokens, pages, namespace)
    return pages


def kv_of(pool: KVPool, pages: list[int]) -> torch.Tensor:
    return torch.stack([torch.stack([kb[pages], vb[pages]]) for kb, vb in zip(pool.k_buffers, pool.v_buffers)])


def files(cache: RadixCache) -> list[Path]:
    assert cache.tier is not None
    return sorted(cache.tier.store.dir.glob("*.kv"))


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    pool, cache = make(tmp_path)
    tokens = list(range(100, 124))  # 6 pages
    before = kv_of(pool, put_prompt(pool, cache, tokens)).clone()
    assert cache.evict(cache.evictable_pages) == 6 and pool.num_free_pages == pool.capacity
    assert len(files(cache)) == 6
    assert cache.tier.load_prefix(cache, tokens + [1], "") == 6  # type: ignore[union-attr]
    m = cache.match_prefix(tokens + [1])
    assert m.num_tokens == 24
    assert torch.equal(kv_of(pool, m.pages).view(torch.int16), before.view(torch.int16))
    cache.check_invariants()
    # Evicting a loaded page again writes nothing (the tier keeps its file).
    spilled = cache.tier.stats.spilled_pages  # type: ignore[union-attr]
    cache.evict(cache.evictable_pages)
    assert cache.tier.stats.spilled_pages == spilled  # type: ignore[union-attr]
    cache.check_invariants()


def test_load_never_serves_the_whole_prompt_and_continues_a_partial_match(tmp_path: Path) -> None:
    pool, cache = make(tmp_path)
    tokens = list(range(24))
    put_prompt(pool, cache, tokens)
    cache.evict(3)  # the tail 3 pages leave the pool; the head 3 stay
    assert cache.match_prefix(tokens + [1]).num_tokens == 12
    assert cache.tier.load_prefix(cache, tokens, "") == 2  # type: ignore[union-attr]  # (24-1)//4 = 5 pages at most
    assert cache.match_prefix(tokens).num_tokens == 20
    cache.check_invariants()


def test_namespaces_never_meet_on_disk(tmp_path: Path) -> None:
    pool, cache = make(tmp_path)
    tokens = list(range(16))
    put_prompt(pool, cache, tokens, namespace="tenant-a")
    cache.evict(cache.evictable_pages)
    assert cache.tier.load_prefix(cache, tokens + [1], "tenant-b") == 0  # type: ignore[union-attr]
    assert cache.tier.load_prefix(cache, tokens + [1], "") == 0  # type: ignore[union-attr]
    assert cache.tier.load_prefix(cache, tokens + [1], "tenant-a") == 4  # type: ignore[union-attr]
    cache.check_invariants()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty", "swap"])
def test_damaged_files_are_misses_and_deleted(tmp_path: Path, damage: str) -> None:
    pool, cache = make(tmp_path)
    tokens = list(range(200, 224))
    before = kv_of(pool, put_prompt(pool, cache, tokens)).clone()
    cache.evict(cache.evictable_pages)
    tier = cache.tier
    assert tier is not None
    # The file of page 3 (keys chain: find it by walking the keys the tree used).
    key = cache.root_key("")
    for i in range(4):
        key = cache.next_key(key, torch.tensor(tokens[i * PS : (i + 1) * PS], dtype=torch.int32).numpy().tobytes())
    victim = tier.store.path(key)
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        victim.write_bytes(b"")
    elif damage == "swap":  # a whole, valid file of another page under this page's name
        victim.write_bytes(files(cache)[0].read_bytes() if files(cache)[0] != victim else files(cache)[1].read_bytes())
    else:  # the same page computed by another model or setting
        other = DiskTier(tmp_path / "elsewhere", 1 << 30, "b" * 32, LAYOUT.page_bytes)
        other.put(key, tier.store.index[key].prefix, b"\0" * LAYOUT.page_bytes, "")
        victim.write_bytes(other.path(key).read_bytes())
        other.close()
    assert tier.load_prefix(cache, tokens + [1], "") == 3  # pages 0-2 load, page 3 is a miss
    assert not victim.exists() and tier.store.stats.bad_files == 1
    m = cache.match_prefix(tokens + [1])
    assert torch.equal(kv_of(pool, m.pages).view(torch.int16), before[:, :, :3].view(torch.int16))
    cache.check_invariants()


def test_index_survives_reopen_and_damage_found_at_start_is_dropped(tmp_path: Path) -> None:
    pool, cache = make(tmp_path)
    a, b = list(range(16)), list(range(50, 66))
    put_prompt(pool, cache, a)
    put_prompt(pool, cache, b)
    cache.tier.persist(cache)  # type: ignore[union-attr]
    cache.tier.store.close()  # type: ignore[union-attr]
    store_dir = cache.tier.store.dir  # type: ignore[union-attr]
    kv_files = sorted(store_dir.glob("*.kv"))
    assert len(kv_files) == 8
    kv_files[0].write_bytes(kv_files[0].read_bytes()[:100])  # torn
    (store_dir / "deadbeefdeadbeef.kv").write_bytes(b"not a page")  # junk
    (store_dir / "0000000000000001.tmp").write_bytes(b"half")  # an interrupted write
    pool2, cache2 = make(tmp_path)
    store = cache2.tier.store  # type: ignore[union-attr]
    assert store.num_pages == 7 and store.stats.bad_files == 2
    assert sorted(p.name for p in store_dir.iterdir() if p.suffix != ".kv") == ["index.json"]
    assert store.bytes == sum(f.stat().st_size for f in store_dir.glob("*.kv"))
    # Files written after the last saved index (a crash) are found by their headers.
    (store_dir / "index.json").unlink()
    store.close()
    pool3, cache3 = make(tmp_path)
    assert cache3.tier.store.num_pages == 7  # type: ignore[union-attr]
    loaded = sum(cache3.tier.load_prefix(cache3, t + [1], "") for t in (a, b))  # type: ignore[union-attr]
    assert loaded >= 7 - 4  # the prompt whose first page was torn loads nothing past it
    cache3.check_invariants()


def test_a_second_process_is_refused_and_the_lock_is_released_on_close(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 20, DIGEST, LAYOUT.page_bytes)
    with pytest.raises(TierLockedError, match=f"pid {os.getpid()}"):
        DiskTier(tmp_path, 1 << 20, "c" * 32, LAYOUT.page_bytes)
    first.close()
    DiskTier(tmp_path, 1 << 20, DIGEST, LAYOUT.page_bytes).close()


def test_size_limit_drops_least_recent_tails(tmp_path: Path) -> None:
    probe_pool, probe = make(tmp_path / "probe")
    put_prompt(probe_pool, probe, list(range(16)))
    probe.evict(4)
    size = max(f.stat().st_size for f in files(probe))  # page files differ by a few header bytes at most
    pool, cache = make(tmp_path / "kv", limit=6 * size + 16)
    prompts = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    for p in prompts:
        put_prompt(pool, cache, p)
        cache.evict(cache.evictable_pages)
    store = cache.tier.store  # type: ignore[union-attr]
    assert store.bytes <= 6 * size + 16 and store.num_pages == 6 and store.stats.lru_evicted_pages == 6
    load = cache.tier.load_prefix  # type: ignore[union-attr]
    assert [load(cache, p + [1], "") for p in prompts] == [0, 2, 4]  # the oldest gone, the middle one's head kept
    cache.check_invariants()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_write_errors_turn_spilling_off_without_raising(tmp_path: Path, monkeypatch, caplog, err: int) -> None:
    pool, cache = make(tmp_path)

    def fail(*args: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(disk_tier_mod.os, "replace", fail)
    put_prompt(pool, cache, list(range(16)))
    assert cache.evict(cache.evictable_pages) == 4  # eviction still frees the pool
    store = cache.tier.store  # type: ignore[union-attr]
    assert not store.writable and store.stats.write_errors == 1 and store.num_pages == 0
    assert "disk full" in caplog.text or "read-only" in caplog.text
    assert not list(store.dir.glob("*.tmp"))
    put_prompt(pool, cache, list(range(50, 66)))
    cache.evict(cache.evictable_pages)  # no second attempt, no second warning
    assert store.stats.write_errors == 1
    assert cache.tier.load_prefix(cache, list(range(17)), "") == 0  # type: ignore[union-attr]
    cache.check_invariants()
    assert pool.num_free_pages == pool.capacity


def test_unusable_directory_means_no_tier(tmp_path: Path, monkeypatch, caplog) -> None:
    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    pool = KVPool(2, 8, PS, 2, 8, torch.bfloat16)
    model = tmp_path / "config.json"
    model.write_text("{}")
    assert open_tier(tmp_path / "kv", 1.0, None, model, "none", pool, 2, 2, 8) is None
    assert "unusable" in caplog.text


def test_int8_pages_round_trip_and_a_tier_in_another_row_layout_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 pages hold 72-byte key rows and 66-byte value rows at head_dim 64, side by side per KV head; they come back
    from disk as they were. The digest names both widths and the page format's version, so pages written in another
    row layout (72-byte value rows, as before values had one scale a row), by format 5 (int8 keys uncentered, before
    radixserve/model/key_center.py) or under other activations sit in another folder and are never read."""
    model = tmp_path / "config.json"
    model.write_text("{}")
    pool = KVPool(2, 16, PS, 2, 64, torch.bfloat16, kv_format=KVFormat("int8"))
    tier = open_tier(tmp_path / "kv", 1.0, None, model, "none", pool, 2, 2, 64)
    assert tier is not None and tier.store is not None
    assert (tier.layout.key_width, tier.layout.value_width) == (72, 66) and tier.layout.page_shape == (2, PS, 2, 138)
    cache = RadixCache(pool, PS)
    cache.tier = tier
    tokens = list(range(200, 216))  # 4 pages
    before = pool.gather_pages(torch.tensor(put_prompt(pool, cache, tokens))).clone()
    assert cache.evict(cache.evictable_pages) == 4 and len(files(cache)) == 4
    assert tier.load_prefix(cache, tokens + [1], "") == 4
    assert torch.equal(pool.gather_pages(torch.tensor(cache.match_prefix(tokens + [1]).pages)), before)
    digest = tier.store.digest
    tier.close(cache)
    old = replace(tier.layout, value_width=72)
    assert kv_digest(model, "none", old) != digest
    assert kv_digest(model, "none", replace(tier.layout, activations="float32")) != digest  # other bytes, same rows
    other = DiskTier(tmp_path / "kv", 1 << 30, kv_digest(model, "none", old), old.page_bytes)
    assert other.num_pages == 0 and other.dir != tier.store.dir
    other.close()
    assert kv_digest_mod.FORMAT_VERSION >= 6
    monkeypatch.setattr(kv_digest_mod, "FORMAT_VERSION", 5)
    assert kv_digest(model, "none", tier.layout) != digest
