"""RadixCache: unit tests for each operation, then stateful property tests against a simple model of the tree."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache

HashFn = Callable[[bytes, int], int]
NAMESPACES = st.sampled_from(["", "other"])
PREFILL = st.sampled_from([1.0, 1.0, 1.0, 0.5, 0.0])  # fraction of the prompt's full pages inserted at admission


def const_hash(data: bytes, seed: int) -> int:
    """Every key collides."""
    return 7


def mod4_hash(data: bytes, seed: int) -> int:
    """Four buckets: frequent collisions mixed with real hits."""
    return xxhash.xxh64_intdigest(data, seed) % 4


def make(page_size: int = 4, num_pages: int = 64, hash_fn: HashFn | None = None) -> tuple[KVPool, RadixCache]:
    """A pool and a tree with a continuation index, so every test also checks that the index follows the tree's pages
    (check_invariants: the index holds exactly the tree's page keys)."""
    pool = KVPool(
        num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1, dtype=torch.float32
    )
    return pool, RadixCache(pool, page_size, hash_fn, index=ContinuationIndex())


def put(pool: KVPool, cache: RadixCache, tokens: Sequence[int], namespace: str = "") -> list[int]:
    """Allocate pages for the full pages of `tokens`, insert them, return the tree's pages."""
    n = len(tokens) // cache.page_size
    pages = pool.alloc(n)
    assert pages is not None
    res = cache.insert(tokens[: n * cache.page_size], pages, namespace)
    assert len(res.pages) == n
    return res.pages


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
    assert len(cache._heap) <= 4 * 2 + 64 + 1
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
    heap = list(cache._heap)
    broken(lambda: cache._heap.clear(), lambda: cache._heap.extend(heap), "eviction heap")


# ---- stateful property tests ----


@dataclass(eq=False)
class Req:
    """A simulated request: pages[:n_tree] belong to the tree (locked through `node`), the rest are private."""

    namespace: str
    tokens: list[int]
    pages: list[int]
    n_tree: int
    node: object


class CacheMachine(RuleBasedStateMachine):
    page_size = 2
    num_pages = 24
    alphabet = 2
    hash_fn: HashFn | None = None

    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(1, self.num_pages, self.page_size, 1, 1, torch.float32)
        self.cache = RadixCache(self.pool, self.page_size, self.hash_fn, index=ContinuationIndex())
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}  # what each page's "KV" was computed from
        self.model: dict[tuple[str, tuple[int, ...]], int] = {}  # exact tree content: (namespace, prefix) -> page
        self.live: set[Req] = set()
        self.history: list[list[int]] = []  # prompts seen so far, reused as prefixes so requests overlap

    # -- helpers --

    def _tokens(self, data: st.DataObject) -> list[int]:
        """A random sequence over a tiny alphabet, often a random cut of an earlier prompt plus a random tail."""
        ps = self.page_size
        n = data.draw(st.integers(0, 3 * ps + 1))
        tail = data.draw(st.lists(st.integers(0, self.alphabet - 1), min_size=n, max_size=n))
        i = data.draw(st.integers(0, len(self.history)))
        if i == len(self.history):
            return tail
        base = self.history[i]
        cut = data.draw(st.sampled_from(sorted({0, len(base), *(j * ps for j in range(len(base) // ps + 1))})))
        return (base[:cut] + tail)[: 7 * ps + 1]

    def _page_of(self, ns: str, tokens: Sequence[int], i: int) -> tuple[str, tuple[int, ...]]:
        ps = self.page_size
        return ns, tuple(tokens[i * ps : (i + 1) * ps])

    def _evict(self, n: int) -> int:
        before = self.cache.evictable_pages
        free_before = self.pool.num_free_pages
        freed = self.cache.evict(n)
        # Unlocked nodes never have locked descendants, so every unlocked page can be reached.
        assert freed == min(max(n, 0), before)
        assert self.pool.num_free_pages == free_before + freed
        self.model = {k: p for k, p in self.model.items() if not self.pool._is_free[p]}
        return freed

    def _alloc(self, n: int) -> list[int] | None:
        pages = self.pool.alloc(n)
        if pages is None:
            self._evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(n)
        return pages

    def _check_match(self, tokens: list[int], ns: str) -> tuple[object, list[int]]:
        ps = self.page_size
        m = self.cache.match_prefix(tokens, ns)
        cap = max(0, (len(tokens) - 1) // ps)
        assert len(m.pages) <= cap and m.num_tokens == len(m.pages) * ps
        for i, p in enumerate(m.pages):
            assert self.content[p] == self._page_of(ns, tokens, i), "match served KV of other tokens or namespace"
            assert self.model[(ns, tuple(tokens[: (i + 1) * ps]))] == p
        longest = 0
        while longest < cap and (ns, tuple(tokens[: (longest + 1) * ps])) in self.model:
            longest += 1
        if self.hash_fn is None:
            assert len(m.pages) == longest, "a strong hash finds the longest cached prefix"
        else:
            assert len(m.pages) <= longest
        return m.node, m.pages

    def _insert(self, req: Req, n: int) -> None:
        """Insert req's first n full pages, adopt the tree's pages, move the lock down if the tree path grew."""
        ps = self.page_size
        mine = req.pages[:n]
        res = self.cache.insert(req.tokens[: n * ps], mine, req.namespace)
        r = len(res.pages)
        assert r >= min(n, req.n_tree), "pages the request already shares with the tree are always found again"
        if self.hash_fn is None:
            assert r == n, "only a collision stops an insert"
        for i, (old, new) in enumerate(zip(mine, res.pages)):
            assert self.content[new] == self._page_of(req.namespace, req.tokens, i)
            assert old == new or self.pool._is_free[old], "a duplicate page is returned to the pool"
            key = (req.namespace, tuple(req.tokens[: (i + 1) * ps]))
            assert self.model.setdefault(key, new) == new, "one page per (namespace, prefix)"
        req.pages[:r] = res.pages
        if r >= req.n_tree:
            self.cache.lock(res.node)
            self.cache.unlock(req.node)  # type: ignore[arg-type]
            req.node, req.n_tree = res.node, r

    # -- rules --

    @rule(target=reqs, data=st.data())
    def new_request(self, data: st.DataObject) -> object:
        tokens, ns = self._tokens(data), data.draw(NAMESPACES)
        self.history.append(tokens)
        node, matched = self._check_match(tokens, ns)
        self.cache.lock(node)  # type: ignore[arg-type]
        need = -(-len(tokens) // self.page_size) - len(matched)
        new = self._alloc(need)
        if new is None:
            self.cache.unlock(node)  # type: ignore[arg-type]
            return multiple()
        for j, p in enumerate(new):
            self.content[p] = self._page_of(ns, tokens, len(matched) + j)
        req = Req(ns, list(tokens), matched + new, len(matched), node)
        self.live.add(req)
        # Prefill: usually the whole prompt goes into the tree at once, sometimes only a chunk or nothing yet.
        self._insert(req, round(data.draw(PREFILL) * (len(tokens) // self.page_size)))
        return req

    @rule(req=reqs, data=st.data())
    def decode(self, req: Req, data: st.DataObject) -> None:
        """Append tokens, allocating pages as the sequence grows (the partial last page stays private)."""
        ps = self.page_size
        more = data.draw(st.lists(st.integers(0, self.alphabet - 1), max_size=2 * ps))
        for t in more:
            if len(req.tokens) == len(req.pages) * ps:
                new = self._alloc(1)
                if new is None:
                    return
                req.pages.extend(new)
            req.tokens.append(t)
            last = len(req.pages) - 1
            self.content[req.pages[last]] = self._page_of(req.namespace, req.tokens, last)

    @rule(req=reqs, frac=st.floats(0, 1))
    def insert_chunk(self, req: Req, frac: float) -> None:
        self._insert(req, round(frac * (len(req.tokens) // self.page_size)))

    @rule(req=consumes(reqs), insert_first=st.booleans())
    def finish(self, req: Req, insert_first: bool) -> None:
        if insert_first:
            self._insert(req, len(req.tokens) // self.page_size)
        self.cache.unlock(req.node)  # type: ignore[arg-type]
        self.pool.free(req.pages[req.n_tree :])
        self.live.discard(req)
        self.history.append(req.tokens)  # a later turn of this conversation may extend it

    @rule(data=st.data())
    def match_only(self, data: st.DataObject) -> None:
        self._check_match(self._tokens(data), data.draw(NAMESPACES))

    @rule(n=st.integers(0, 12), roll=st.integers(0, 2))
    def evict(self, n: int, roll: int) -> None:
        if roll == 0:  # a third of the draws: eviction also runs whenever an allocation falls short
            self._evict(n)

    @rule(roll=st.integers(0, 7))
    def reset(self, roll: int) -> None:
        if roll:  # rare: a reset wipes the state the other rules build up
            return
        if self.cache.protected_pages:
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.cache.reset()
        self.model.clear()

    # -- invariants --

    @invariant()
    def tree_and_pool_agree(self) -> None:
        self.cache.check_invariants()
        private = sum(len(r.pages) - r.n_tree for r in self.live)
        assert self.pool.num_free_pages + self.cache.total_pages + private == self.pool.capacity, "page leak"
        assert len(self.model) == self.cache.total_pages
        for r in self.live:
            assert all(not self.pool._is_free[p] for p in r.pages), "a live request's page was freed"
            assert len(set(r.pages)) == len(r.pages)


def _machine(page_size: int, hash_fn: HashFn | None, alphabet: int) -> type[CacheMachine]:
    body = {"page_size": page_size, "alphabet": alphabet, "hash_fn": staticmethod(hash_fn) if hash_fn else None}
    return type(f"CacheMachine_ps{page_size}", (CacheMachine,), body)


@pytest.mark.parametrize(
    ("page_size", "hash_fn", "alphabet"),
    [(1, None, 3), (2, None, 2), (16, None, 2), (2, mod4_hash, 2), (1, const_hash, 3), (4, const_hash, 2)],
    ids=["ps1", "ps2", "ps16", "ps2-mod4hash", "ps1-consthash", "ps4-consthash"],
)
def test_random_operations_keep_invariants(page_size: int, hash_fn: HashFn | None, alphabet: int) -> None:
    run_state_machine_as_test(
        _machine(page_size, hash_fn, alphabet),
        settings=settings(
            max_examples=60,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


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
