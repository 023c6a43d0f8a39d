"""RadixCache: unit tests for each operation (the stateful property tests are in test_radix_cache_stateful.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from radix_helpers import HashFn, const_hash, make, put

# ---- match ----


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_never_returns_the_whole_prompt(ps: int) -> None:
    pool, cache = make(ps)
    tokens = list(range(3 * ps))
    pages = put(pool, cache, tokens)
    assert cache.match_prefix(tokens).pages == pages[:2]
    assert cache.match_prefix(tokens + [999]).pages == pages
    assert cache.match_prefix(tokens[:1]).pages == []
    assert cache.match_prefix([]).pages == []
    cache.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_match_ignores_partial_last_page_and_divergence(ps: int) -> None:
    pool, cache = make(ps)
    tokens = list(range(4 * ps))
    pages = put(pool, cache, tokens)
    m = cache.match_prefix(tokens[: 2 * ps + ps // 2 + 1])  # 2 full pages + a partial one
    assert m.pages == pages[:2] and m.num_tokens == 2 * ps
    diverged = tokens[: ps + 1] + [-5] * (3 * ps)  # token ps+1 differs: inside page 1, or page 2 when ps == 1
    assert cache.match_prefix(diverged).pages == pages[: 2 if ps == 1 else 1]
    cache.check_invariants()


def test_match_accepts_numpy_and_tensor_tokens() -> None:
    pool, cache = make(4)
    tokens = list(range(100, 112))
    pages = put(pool, cache, tokens)
    assert cache.match_prefix(np.array(tokens + [1], dtype=np.int64)).pages == pages
    assert cache.match_prefix(torch.tensor(tokens + [1])).pages == pages


def test_match_splits_node_at_page_boundary() -> None:
    pool, cache = make(4)
    tokens = list(range(16))
    pages = put(pool, cache, tokens)
    m = cache.match_prefix(tokens[:9])
    assert m.pages == pages[:2] and m.node.pages == pages[:2]
    (child,) = m.node.children.values()
    assert child.pages == pages[2:] and child.parent is m.node
    assert m.node.tokens == tokens[:8] and child.tokens == tokens[8:]
    cache.check_invariants()


# ---- insert ----


def test_insert_frees_duplicates_and_returns_tree_pages() -> None:
    pool, cache = make(4, num_pages=16)
    tokens = list(range(12))
    first = put(pool, cache, tokens)
    free_before = pool.num_free_pages
    mine = pool.alloc(4)
    assert mine is not None
    res = cache.insert(tokens + [50, 51, 52, 53], mine)
    assert res.pages == first + [mine[3]]
    assert pool.num_free_pages == free_before - 1  # three duplicates went back to the pool
    assert all(pool._is_free[p] for p in mine[:3])
    cache.check_invariants()


def test_insert_keeps_pages_already_pointing_at_the_tree() -> None:
    pool, cache = make(4, num_pages=16)
    tokens = list(range(8))
    tree = put(pool, cache, tokens)
    m = cache.match_prefix(tokens + [9, 9, 9, 9, 9])
    extra = pool.alloc(1)
    assert extra is not None and m.pages == tree
    free_before = pool.num_free_pages
    res = cache.insert(tokens + [9, 9, 9, 9], m.pages + extra)
    assert res.pages == tree + extra and pool.num_free_pages == free_before
    cache.check_invariants()


def test_insert_rejects_partial_pages() -> None:
    pool, cache = make(4)
    with pytest.raises(ValueError):
        cache.insert(list(range(6)), [1, 2])
    assert cache.insert([], []).pages == []


def test_insert_divergent_suffix_splits() -> None:
    pool, cache = make(2)
    a = put(pool, cache, [1, 1, 2, 2, 3, 3])
    b = put(pool, cache, [1, 1, 2, 2, 4, 4, 5, 5])
    assert b[:2] == a[:2] and b[2] != a[2]
    (shared,) = cache.root.children.values()
    assert shared.pages == a[:2] and len(shared.children) == 2
    assert cache.total_pages == 5
    cache.check_invariants()


# ---- lock / unlock ----


def test_lock_unlock_counts_and_negative_raises() -> None:
    pool, cache = make(4)
    tokens = list(range(12))
    put(pool, cache, tokens)
    m = cache.match_prefix(tokens + [0])
    assert (cache.evictable_pages, cache.protected_pages) == (3, 0)
    cache.lock(m.node)
    cache.lock(m.node)
    assert (cache.evictable_pages, cache.protected_pages, cache.total_pages) == (0, 3, 3)
    cache.unlock(m.node)
    assert cache.protected_pages == 3
    cache.unlock(m.node)
    assert (cache.evictable_pages, cache.protected_pages) == (3, 0)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    assert m.node.lock_ref == 0
    cache.lock(cache.root)  # the root is never counted
    cache.unlock(cache.root)
    cache.check_invariants()


def test_split_keeps_lock_counts() -> None:
    pool, cache = make(4)
    tokens = list(range(16))
    put(pool, cache, tokens)
    deep = cache.match_prefix(tokens + [0]).node
    cache.lock(deep)
    shallow = cache.match_prefix(tokens[:5]).node  # splits `deep`'s node after page 1
    assert shallow is deep.parent and shallow.lock_ref == 1 and deep.lock_ref == 1
    assert cache.protected_pages == 4
    assert cache.evict(100) == 0
    cache.check_invariants()
    cache.unlock(deep)
    assert shallow.lock_ref == 0 and cache.evictable_pages == 4
    cache.check_invariants()


def test_lock_of_evicted_node_raises() -> None:
    pool, cache = make(4)
    put(pool, cache, list(range(8)))
    node = cache.match_prefix(list(range(9))).node
    assert cache.evict(2) == 2
    with pytest.raises(RuntimeError):
        cache.lock(node)


# ---- eviction ----


def test_evict_lru_order() -> None:
    pool, cache = make(4)
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    for t in (a, b, c):
        put(pool, cache, t)
    cache.match_prefix(a + [0])  # touch a: b is now the least recent
    assert cache.evict(2) == 2
    assert cache.match_prefix(b + [0]).pages == []
    assert len(cache.match_prefix(a + [0]).pages) == 2 and len(cache.match_prefix(c + [0]).pages) == 2
    cache.match_prefix(a + [0])  # c is now the least recent
    assert cache.evict(2) == 2
    assert cache.match_prefix(c + [0]).pages == [] and len(cache.match_prefix(a + [0]).pages) == 2
    cache.check_invariants()


def test_evict_trims_tail_pages_of_a_long_leaf() -> None:
    pool, cache = make(4)
    tokens = list(range(16))
    pages = put(pool, cache, tokens)
    assert cache.evict(1) == 1
    assert pool._is_free[pages[3]]
    assert cache.match_prefix(tokens + [0]).pages == pages[:3]
    cache.check_invariants()


def test_evicting_children_makes_parent_evictable() -> None:
    pool, cache = make(2)
    put(pool, cache, [1, 1, 2, 2, 3, 3])
    put(pool, cache, [1, 1, 2, 2, 4, 4])
    keep = cache.match_prefix([1, 1, 2, 2, 4, 4, 0]).node
    cache.lock(keep)
    assert cache.evict(100) == 1  # only the unlocked sibling leaf
    cache.check_invariants()
    cache.unlock(keep)
    free_before = pool.num_free_pages
    assert cache.evict(100) == 3  # the leaf, then its parent once it became a leaf
    assert cache.total_pages == 0 and pool.num_free_pages == free_before + 3
    cache.check_invariants()


def test_evict_zero_and_empty() -> None:
    pool, cache = make(4)
    assert cache.evict(5) == 0
    put(pool, cache, list(range(8)))
    assert cache.evict(0) == 0 and cache.total_pages == 2


# ---- namespaces, collisions, reset ----


@pytest.mark.parametrize("hash_fn", [None, const_hash], ids=["xxh64", "const"])
def test_namespaces_never_share(hash_fn: HashFn | None) -> None:
    pool, cache = make(4, hash_fn=hash_fn)
    tokens = list(range(8))
    a = put(pool, cache, tokens, "alice")
    assert cache.match_prefix(tokens + [0], "bob").pages == []
    assert cache.match_prefix(tokens + [0]).pages == []
    mine = pool.alloc(2)
    assert mine is not None
    res = cache.insert(tokens, mine, "bob")
    assert not set(res.pages) & set(a)
    if hash_fn is None:
        assert res.pages == mine
        assert cache.match_prefix(tokens + [0], "bob").pages == mine
    else:  # the namespaces' root keys collide: bob's insert stops at once and bob keeps his pages
        assert res.pages == []
    assert cache.match_prefix(tokens + [0], "alice").pages == a
    cache.check_invariants()


def test_collision_never_serves_other_tokens() -> None:
    pool, cache = make(4, hash_fn=const_hash)
    a = put(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix([9, 9, 9, 9, 9]).pages == []
    mine = pool.alloc(2)
    assert mine is not None
    res = cache.insert([9, 9, 9, 9, 1, 1, 1, 1], mine)
    assert res.pages == [] and not pool._is_free[mine[0]]  # stopped at once; the caller still owns its pages
    pool.free(mine)
    # Collision one page deep: the shared first page is reused, the second page collides with a's.
    mine = pool.alloc(2)
    assert mine is not None
    res = cache.insert([1, 2, 3, 4, 0, 0, 0, 0], mine)
    assert res.pages == a[:1] and pool._is_free[mine[0]] and not pool._is_free[mine[1]]
    assert cache.match_prefix([1, 2, 3, 4, 0, 0, 0, 0, 0]).pages == a[:1]
    cache.check_invariants()


def test_reset_frees_everything_and_refuses_when_locked() -> None:
    pool, cache = make(4, num_pages=32)
    put(pool, cache, list(range(12)))
    put(pool, cache, list(range(4)) + [7] * 8)
    node = cache.match_prefix(list(range(12)) + [0]).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_pages == 0 and pool.num_free_pages == pool.capacity
    assert cache.match_prefix(list(range(12)) + [0]).pages == []
    cache.check_invariants()
    put(pool, cache, list(range(8)))  # still usable
    cache.check_invariants()


def test_heap_of_stale_entries_stays_bounded() -> None:
    pool, cache = make(4)
    a = put(pool, cache, list(range(8)))
    b = put(pool, cache, list(range(100, 108)))
    for _ in range(500):
        cache.match_prefix(list(range(9)))
        cache.match_prefix(list(range(100, 109)))
    assert len(cache.order.leaves) <= 4 * 2 + 64 + 1
    cache.check_invariants()
    cache.match_prefix(list(range(9)))
    assert cache.evict(2) == 2 and all(pool._is_free[p] for p in b) and cache.match_prefix(list(range(9))).pages == a


# ---- the invariant checker itself catches corruption ----


def test_check_invariants_catches_corruption() -> None:
    pool, cache = make(2)
    put(pool, cache, [1, 1, 2, 2, 3, 3])
    put(pool, cache, [1, 1, 2, 2, 4, 4])
    (shared,) = cache.root.children.values()
    leaf = next(iter(shared.children.values()))

    def broken(mutate: Callable[[], None], undo: Callable[[], None], rule: str) -> None:
        mutate()
        with pytest.raises(AssertionError, match=rule):
            cache.check_invariants()
        undo()
        cache.check_invariants()

    key = leaf.keys[0]
    broken(lambda: leaf.keys.__setitem__(0, key ^ 1), lambda: leaf.keys.__setitem__(0, key), "children dict key")
    tb = leaf.token_bytes
    broken(lambda: setattr(leaf, "token_bytes", b"\x09" + tb[1:]), lambda: setattr(leaf, "token_bytes", tb), "page key")
    broken(lambda: setattr(leaf, "lock_ref", 1), lambda: setattr(leaf, "lock_ref", 0), "lock_ref >= the sum")
    broken(lambda: setattr(shared, "lock_ref", -1), lambda: setattr(shared, "lock_ref", 0), "lock_ref >= 0")
    page = leaf.pages[0]
    broken(lambda: leaf.pages.__setitem__(0, shared.pages[0]), lambda: leaf.pages.__setitem__(0, page), "twice")
    broken(lambda: pool.free([page]), lambda: pool._free.remove(page) or pool._is_free.__setitem__(page, False), "free")
    heap = list(cache.order.leaves)
    broken(lambda: cache.order.leaves.clear(), lambda: cache.order.leaves.extend(heap), "eviction heap")


# ---- continuation index (speculative drafts from the tree, issue 16) ----------------------------------------------


def test_continuation_index_drafts_what_followed_and_forgets_evicted_pages() -> None:
    pool, cache = make(4, num_pages=32)
    assert cache.index is not None
    seq = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # three pages
    put(pool, cache, seq)
    draft = cache.index.lookup("", [99, 11, 12, 13], 5)
    assert draft is not None and draft.tokens == [14, 15, 16, 17, 18] and draft.match == 3
    # a query whose longer context matches scores a longer match; other namespaces see nothing
    assert cache.index.lookup("", [10, 11, 12, 13], 2).match == 4
    assert cache.index.lookup("other", [11, 12, 13], 2) is None
    # evicting the tail page shortens the continuation to what the tree still holds
    assert cache.evict(1) == 1
    cache.check_invariants()
    assert cache.index.lookup("", [11, 12, 13], 8).tokens == [14, 15, 16, 17]
    assert cache.index.lookup("", [17, 18, 19], 3) is None  # its gram lived in the evicted page
    # a later sequence with the same gram and another continuation replaces what the evicted one drafted
    cache.evict(2)
    assert len(cache.index) == 0 and cache.index.lookup("", [11, 12, 13], 4) is None
    put(pool, cache, [11, 12, 13, 40, 41, 42, 43, 44])
    assert cache.index.lookup("", [11, 12, 13], 4).tokens == [40, 41, 42, 43]
    cache.check_invariants()
    cache.reset()
    assert len(cache.index) == 0


def test_continuation_index_follows_splits_and_the_latest_branch() -> None:
    pool, cache = make(2, num_pages=32)
    put(pool, cache, [1, 2, 3, 4, 5, 6])
    put(pool, cache, [1, 2, 3, 4, 7, 8])  # splits the first node after two pages; a newer branch
    cache.check_invariants()
    assert cache.index.lookup("", [2, 3, 4], 4).tokens == [7, 8]  # the branch inserted last
    assert cache.index.lookup("", [1, 2], 1) is None  # shorter than a gram
