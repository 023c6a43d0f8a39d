"""Partial-page reuse (issue 19): a prompt that continues into a cached partial page copies the rows it matches.

Greedy outputs must equal those with the feature off (DESIGN.md rule 1) for shared prefixes ending at every offset
inside a page, concurrent forks, chunked prefill, overlap, retraction and aborts; every engine test ends at rest with
no page leaked (the make_engine fixture, rule 2); the copy reads only the matched rows."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from engine_checks import abort_after, leave_stream_after, wait_idle
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.partial_page import MAX_TAILS_PER_KEY, PartialPages, PartialTail
from radixserve.cache.radix_cache import RadixCache

PS = 16
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def prefix_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def suffix_ids(rng: random.Random, n: int) -> list[int]:
    """Tokens from another range than prefix_ids: a suffix never continues a prefix by chance."""
    return [rng.randrange(250, 500) for _ in range(n)]


def spy_copies(eng) -> list[tuple[list[int], list[int]]]:
    """Record every (source slots, destination slots) the runner copies."""
    pool = eng.runner.pool
    seen: list[tuple[list[int], list[int]]] = []
    real = pool.copy_slots

    def copy_slots(src: torch.Tensor, dst: torch.Tensor) -> None:
        seen.append((src.tolist(), dst.tolist()))
        real(src, dst)

    pool.copy_slots = copy_slots
    return seen


@pytest.mark.parametrize("owner_tokens", [1, 8])
def test_every_offset_inside_a_page_matches_the_feature_off(
    tiny_model_dir: Path, make_engine, owner_tokens: int
) -> None:
    """The owner's prompt is 2 pages + 15 tokens. Readers share its first 32 + j tokens, j = 0..15. With one output
    token the owner's partial page is kept as a tail; with 8 it fills and enters the tree as a full page, which the
    readers then leave part way: both are sources."""
    rng = random.Random(11)
    owner = prefix_ids(rng, 2 * PS + 15)
    readers = [owner[: 2 * PS + j] + suffix_ids(rng, 5) for j in range(PS)]
    outs = {}
    for on in (False, True):
        eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048, enable_partial_page_reuse=on)
        copies = spy_copies(eng)
        eng.generate(input_ids=owner, sampling_params={**GREEDY, "max_new_tokens": owner_tokens})
        got = []
        for j, ids in enumerate(readers):
            out = eng.generate(input_ids=ids, sampling_params=GREEDY)
            assert out["meta_info"]["cached_tokens"] == 2 * PS + (j if on else 0), j
            got.append(out["output_ids"])
        outs[on] = got
        stats = eng.cache_stats()
        assert stats["partial_page_hit_tokens"] == (sum(range(PS)) if on else 0)
        assert len(copies) == (PS - 1 if on else 0)  # j = 0 matches no row: nothing to copy
        eng.check_invariants()
    assert outs[True] == outs[False]


def test_the_copy_reads_only_the_matched_rows(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(12)
    owner = prefix_ids(rng, PS + 12)
    eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048)
    copies = spy_copies(eng)
    eng.generate(input_ids=owner, sampling_params={**GREEDY, "max_new_tokens": 1})
    kept = eng.loop.call(lambda: [t.page for ts in eng.scheduler.partial._by_key.values() for t in ts])
    assert len(kept) == 1
    page = kept[0]
    for j in (1, 5, 11):  # the reader matches j of the tail's 12 tokens
        out = eng.generate(input_ids=owner[: PS + j] + suffix_ids(rng, 3), sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] == PS + j
        src, dst = copies[-1]
        assert src == [page * PS + r for r in range(j)], "rows 0..j-1 of the tail's page, nothing past them"
        assert [d % PS for d in dst] == list(range(j)) and len({d // PS for d in dst}) == 1
        assert dst[0] // PS != page, "the reader writes its own page, never the shared one"


def test_copy_slots_touches_only_the_named_slots() -> None:
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).reshape(buf.shape))
        buf[1, 2:] = float("nan")  # rows past the match in the source page
    before = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers)]
    pool.copy_slots(torch.tensor([4, 5]), torch.tensor([12, 13]))  # rows 0, 1 of page 1 -> rows 0, 1 of page 3
    for b, old in zip((*pool.k_buffers, *pool.v_buffers), before):
        assert torch.equal(b[3, :2], old[1, :2])
        assert torch.equal(b[3, 2:], old[3, 2:]) and not b[3].isnan().any()
        assert (
            torch.equal(b[:3], old[:3])
            if not old[:3].isnan().any()
            else torch.equal(b[:3].nan_to_num(), old[:3].nan_to_num())
        )


@pytest.mark.parametrize("overlap", [False, True])
def test_concurrent_forks_and_chunked_prefill_match_the_feature_off(
    tiny_model_dir: Path, make_engine, overlap: bool
) -> None:
    """Branches sent together: the first computes the shared prefix and the others copy its partial page while it
    still runs (a live tail); chunks of 20 tokens end inside pages, so tails are recorded mid-prefill too."""
    rng = random.Random(13)
    shared = prefix_ids(rng, 3 * PS + 7)
    branches = [shared + suffix_ids(rng, rng.randrange(3, 30)) for _ in range(6)]
    tails = [shared[: 3 * PS + 2] + suffix_ids(rng, 4), shared[: PS - 3] + suffix_ids(rng, 4)]
    outs, stats = {}, {}
    for on in (False, True):
        eng = make_engine(
            tiny_model_dir,
            page_size=PS,
            max_total_tokens=4096,
            enable_partial_page_reuse=on,
            chunked_prefill_size=20,
            overlap_schedule=overlap,
        )
        first = eng.generate(input_ids=branches + tails, sampling_params={**GREEDY, "max_new_tokens": 6})
        second = eng.generate(input_ids=tails, sampling_params=GREEDY)
        outs[on] = [o["output_ids"] for o in first + second]
        stats[on] = eng.cache_stats()
        eng.check_invariants()
    assert outs[True] == outs[False]
    assert stats[False]["partial_page_hit_tokens"] == 0 and stats[True]["partial_page_hit_tokens"] > 0
    assert stats[True]["hit_tokens"] > stats[False]["hit_tokens"]


def test_retraction_under_memory_pressure_matches_the_feature_off(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(14)
    shared = prefix_ids(rng, PS + 9)
    prompts = [shared + suffix_ids(rng, 3 + i) for i in range(6)]
    params = {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}
    outs, retractions = {}, {}
    for on in (False, True):
        # 20 pages; six requests of ~80 tokens each. A low decode reservation over-admits on purpose.
        eng = make_engine(
            tiny_model_dir, page_size=PS, max_total_tokens=320, init_new_token_ratio=0.05, enable_partial_page_reuse=on
        )
        eng.generate(input_ids=shared, sampling_params={**GREEDY, "max_new_tokens": 1})
        outs[on] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        retractions[on] = eng.metrics()["num_retractions"]
        eng.check_invariants()
    assert outs[True] == outs[False]
    assert retractions[True] > 0 and retractions[False] > 0


async def test_aborts_of_owners_and_readers_leak_nothing(tiny_model_dir: Path, make_engine) -> None:
    eng = make_engine(
        tiny_model_dir, page_size=PS, max_total_tokens=1024, chunked_prefill_size=20, max_running_requests=4
    )
    rng = random.Random(15)
    shared = prefix_ids(rng, 2 * PS + 5)

    jobs = []
    for i in range(12):
        ids = shared[: rng.randrange(PS, len(shared) + 1)] + suffix_ids(rng, rng.choice([1, 9, 40]))
        jobs.append(
            leave_stream_after(eng, ids, rng.randrange(1, 6))
            if i % 2
            else abort_after(eng, ids, rng.random() * 0.05, f"r{i}")
        )
    await asyncio.gather(*jobs)
    await asyncio.to_thread(wait_idle, eng)
    eng.check_invariants()
    # and the engine still answers as with the feature off
    ids = shared + suffix_ids(rng, 4)
    want = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=1024, enable_partial_page_reuse=False)
    assert (await eng.async_generate(input_ids=ids, sampling_params=GREEDY))["output_ids"] == (
        await want.async_generate(input_ids=ids, sampling_params=GREEDY)
    )["output_ids"]


def test_kept_partial_pages_are_evicted_first_and_never_leak(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(16)
    eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=320)
    for _ in range(4):  # 4 prompts of 1 page + 9 tokens: 4 full pages and 4 kept partial pages
        eng.generate(input_ids=prefix_ids(rng, PS + 9), sampling_params={**GREEDY, "max_new_tokens": 1})
    stats = eng.cache_stats()
    assert (stats["cached_pages"], stats["partial_pages"]) == (8, 4)
    # 16 pages wanted, 12 free: the 4 kept partial pages go, and no full page of the tree
    eng.generate(input_ids=prefix_ids(rng, 16 * PS), sampling_params={**GREEDY, "max_new_tokens": 1})
    stats = eng.cache_stats()
    assert stats["partial_pages"] == 0 and stats["cached_pages"] == 4 + 16, stats
    eng.check_invariants()


def test_namespaces_never_share_a_partial_page(tiny_model_dir: Path, make_engine) -> None:
    rng = random.Random(17)
    ids = prefix_ids(rng, 10)  # shorter than a page: only a partial page (at the namespace's root) could serve it
    eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048)
    eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="a")
    other = eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="b")
    same = eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="a")
    assert other["meta_info"]["cached_tokens"] == 0 and same["meta_info"]["cached_tokens"] == 9
    assert same["output_ids"] == other["output_ids"]


def test_page_size_one_and_cache_off_have_no_partial_pages(tiny_model_dir: Path, make_engine) -> None:
    ids = prefix_ids(random.Random(18), 20)
    for kw in ({"page_size": 1}, {"enable_radix_cache": False}):
        eng = make_engine(tiny_model_dir, max_total_tokens=1024, **kw)
        assert eng.scheduler.partial is None
        eng.generate(input_ids=ids, sampling_params=GREEDY)
        assert eng.cache_stats()["partial_page_hit_tokens"] == 0


# ---- the registry alone ------------------------------------------------------------------------------------------


def _registry() -> tuple[KVPool, RadixCache, PartialPages]:
    pool = KVPool(num_layers=1, num_pages=32, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return pool, RadixCache(pool, 4), PartialPages(pool, 4)


def _keep(reg: PartialPages, cache: RadixCache, node, tokens: list[int]) -> tuple[PartialTail | None, int]:
    """Record a live tail on a fresh page, then let its owner go with keep=True; returns (record, page)."""
    import numpy as np

    page = reg.pool.alloc(1)[0]
    key = cache.root_key("") if node is cache.root else node.keys[-1]
    tail = reg.note(None, key, node, "", np.asarray(tokens, dtype="<i4").tobytes(), page, owner=object())
    if not reg.release(tail, keep=True):
        reg.pool.free([page])
        return None, page
    return tail, page


def test_registry_keeps_the_longest_tail_and_a_few_per_prefix() -> None:
    pool, cache, reg = _registry()
    free0 = pool.num_free_pages
    root = cache.root
    _keep(reg, cache, root, [5, 6])
    assert reg.kept_pages == 1
    assert _keep(reg, cache, root, [5])[0] is None, "a kept tail already covers it"
    _keep(reg, cache, root, [5, 6, 7])  # extends the first: replaces it
    assert reg.kept_pages == 1
    hit = reg.lookup(root, cache.root_key(""), "", bytes(__import__("numpy").asarray([5, 6, 9], "<i4")), True)
    assert hit is not None and hit.num_tokens == 2
    for t in range(10, 10 + MAX_TAILS_PER_KEY + 2):
        _keep(reg, cache, root, [t])
    assert reg.kept_pages == MAX_TAILS_PER_KEY
    reg.check_invariants()
    assert reg.evict(2) == 2 and reg.kept_pages == MAX_TAILS_PER_KEY - 2
    reg.reset()
    assert pool.num_free_pages == free0


def test_registry_drops_a_tail_whose_prefix_was_evicted() -> None:
    import numpy as np

    pool, cache, reg = _registry()
    pages = pool.alloc(2)
    res = cache.insert(list(range(8)), pages)
    tail, page = _keep(reg, cache, res.node, [8, 9])
    query = np.asarray([8, 9, 10], "<i4").tobytes()
    assert reg.lookup(res.node, res.node.keys[-1], "", query, False).page == page
    assert cache.evict(1) == 1  # the node loses its last page: the tail no longer follows it
    assert reg.lookup(res.node, tail.key, "", query, False) is None
    assert reg.kept_pages == 0 and pool.is_free(page)
    reg.check_invariants()


@pytest.mark.parametrize("shared", [5, PS + 4])
def test_requests_sent_together_share_rows_past_their_cached_pages(
    tiny_model_dir: Path, make_engine, shared: int
) -> None:
    """Two prompts sharing `shared` tokens, nothing cached: the second waits a step (as it would for a shared full
    page) and copies the rows the first computed, as page size 1 would reuse them."""
    rng = random.Random(19)
    common = prefix_ids(rng, shared)
    prompts = [common + suffix_ids(rng, 12), common + suffix_ids(rng, 9)]
    outs = {}
    for on in (False, True):
        eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048, enable_partial_page_reuse=on)
        got = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        outs[on] = [o["output_ids"] for o in got]
        cached = sorted(o["meta_info"]["cached_tokens"] for o in got)
        assert cached == ([0, shared] if on else [0, shared // PS * PS])
    assert outs[True] == outs[False]


def test_a_failed_step_with_a_copy_caches_nothing_of_it(
    tiny_model_dir: Path, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.errors import RequestFailedError

    rng = random.Random(20)
    owner = prefix_ids(rng, PS + 11)
    reader = owner[: PS + 7] + suffix_ids(rng, 6)
    want = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048, enable_partial_page_reuse=False)
    want_ids = want.generate(input_ids=reader, sampling_params=GREEDY)["output_ids"]
    eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048)
    eng.generate(input_ids=owner, sampling_params={**GREEDY, "max_new_tokens": 1})
    real = eng.runner.forward

    def fail_once(batch):
        monkeypatch.setattr(eng.runner, "forward", real)
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(eng.runner, "forward", fail_once)  # fails the step that copies (after the copy ran)
    with pytest.raises(RequestFailedError):
        eng.generate(input_ids=reader, sampling_params=GREEDY)
    wait_idle(eng)
    eng.check_invariants()
    assert eng.cache_stats()["partial_pages"] == 1  # still the owner's alone
    again = eng.generate(input_ids=reader, sampling_params=GREEDY)
    assert again["output_ids"] == want_ids and again["meta_info"]["cached_tokens"] == PS + 7


async def test_a_reader_copies_from_a_running_owner_that_keeps_writing(tiny_model_dir: Path, make_engine) -> None:
    """The owner decodes on into its partial page (rows past those it recorded) while a reader copies the recorded
    rows it matches; the reader's tokens equal the feature off's."""
    rng = random.Random(21)
    owner = prefix_ids(rng, PS + 9)
    reader = owner[: PS + 5] + suffix_ids(rng, 6)
    want = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048, enable_partial_page_reuse=False)
    want_ids = (await want.async_generate(input_ids=reader, sampling_params=GREEDY))["output_ids"]
    eng = make_engine(tiny_model_dir, page_size=PS, max_total_tokens=2048)
    copies = spy_copies(eng)
    stream = eng.async_generate(
        input_ids=owner, sampling_params={"max_new_tokens": 400, "ignore_eos": True}, stream=True
    )
    await stream.__anext__()  # the owner has prefilled and decodes on
    got = await eng.async_generate(input_ids=reader, sampling_params=GREEDY)
    owner_pages = await asyncio.to_thread(eng.loop.call, lambda: [r.pages for r in eng.scheduler.running])
    await stream.aclose()  # aborts the owner
    assert got["output_ids"] == want_ids and got["meta_info"]["cached_tokens"] == PS + 5
    assert [src for src, _ in copies] == [[owner_pages[0][1] * PS + r for r in range(5)]], "the owner's live page"
