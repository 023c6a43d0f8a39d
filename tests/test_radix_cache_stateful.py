"""RadixCache: stateful property tests against a simple model of the tree (random inserts, matches, locks,
evictions and namespaces; every step checks the tree's invariants)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
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

from radixserve.cache.retention import Retention
from radix_helpers import HashFn, const_hash, make, mod4_hash

NAMESPACES = st.sampled_from(["", "other"])
PREFILL = st.sampled_from([1.0, 1.0, 1.0, 0.5, 0.0])  # fraction of the prompt's full pages inserted at admission


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
        self.pool, self.cache = make(self.page_size, self.num_pages, self.hash_fn)
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}  # what each page's "KV" was computed from
        self.model: dict[tuple[str, tuple[int, ...]], int] = {}  # exact tree content: (namespace, prefix) -> page
        self.live: set[Req] = set()
        self.history: list[list[int]] = []  # prompts seen so far, reused as prefixes so requests overlap
        self.clock = 0.0  # retention's clock, advanced by a rule
        self.cache.now = lambda: self.clock

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
        self.cache.order.expire(self.clock)  # what evict does first: a retention that ran out is plain LRU
        retained = [p for x in self.cache._nodes() if x.priority and not x.lock_ref for p in x.pages]
        freed = self.cache.evict(n)
        # Unlocked nodes never have locked descendants, so every unlocked page can be reached.
        assert freed == min(max(n, 0), before)
        assert self.pool.num_free_pages == free_before + freed
        self.model = {k: p for k, p in self.model.items() if not self.pool._is_free[p]}
        if any(self.pool._is_free[p] for p in retained):  # retention's order: every plain leaf went first
            plain = [x for x in self.cache._nodes() if not x.children and not x.lock_ref and not x.priority]
            assert not plain, "a retained page was evicted while an unlocked plain leaf stayed"
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

    @rule(req=reqs, seconds=st.floats(0.5, 20), priority=st.integers(1, 100), tenant=st.sampled_from(["", "a"]))
    def retain(self, req: Req, seconds: float, priority: int, tenant: str) -> None:
        """Retain a live request's path (budgets, splits, expiry and eviction order must keep the tree whole)."""
        if req.node is not self.cache.root:
            self.cache.retain(req.node, Retention(seconds, priority, tenant))  # type: ignore[arg-type]

    @rule(dt=st.floats(0, 15))
    def time_passes(self, dt: float) -> None:
        self.clock += dt

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
