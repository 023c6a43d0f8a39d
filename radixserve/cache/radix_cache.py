"""Radix cache: a tree of full KV pages keyed by chained token hashes, with locking and eviction by retention
priority, then LRU (retention.py).

Page key h = hash(parent_h (8 bytes LE) || page tokens (int32 LE)), the chain starting at a key derived from the
request's cache namespace. A node owns a run of consecutive pages; a parent finds a child by the key of the child's
first page. Every key hit is confirmed by comparing tokens, so a hash collision is a miss, never another prompt's KV.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.cache.tree_node import InsertResult, MatchResult, TreeNode, as_bytes, first_diff_page
from radixserve.cache.tree_check import check_tree
from radixserve.cache.tree_peek import peek_path
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.retention import EvictionOrder, Retention

if TYPE_CHECKING:
    from radixserve.cache.kv_tier import KVTier

_MASK64 = (1 << 64) - 1
_SEED = 0
_NS_PREFIX = b"radixserve-namespace:"


class RadixCache:
    """Prefix cache over a KVPool: the tree owns the pages it holds and frees them on eviction or reset.

    lock_ref counts locks on a node and its descendants; the root is never counted. (NullCache, in
    null_cache.py, has the same interface for an engine with caching off.)
    """

    enabled = True

    def __init__(
        self,
        pool: KVPool,
        page_size: int,
        hash_fn: Callable[[bytes, int], int] | None = None,
        index: ContinuationIndex | None = None,
        retained_share: float = 0.5,
        retained_share_per_tenant: float = 0.5,
    ) -> None:
        if page_size != pool.page_size:
            raise ValueError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        self.pool = pool
        self.page_size = page_size
        self._page_bytes = 4 * page_size
        self._hash_fn = hash_fn if hash_fn is not None else xxhash.xxh64_intdigest
        self._ids = itertools.count()
        self._clock = 0
        cap = pool.capacity
        self.order = EvictionOrder(int(retained_share * cap), int(retained_share_per_tenant * cap))
        self.now: Callable[[], float] = time.monotonic  # retention's clock (tests set their own)
        self._num_nodes = self._evictable = self._protected = 0
        self.root = self._new_root()
        # Speculative drafts from the tree (see continuation_index.py): follows every page the tree gains or loses.
        self.index = index
        # Where evicted pages go and matches continue (radixserve/cache/kv_tier.py); None: evicted KV is dropped.
        self.tier: KVTier | None = None

    # ---- keys ----

    def _hash(self, data: bytes) -> int:
        return self._hash_fn(data, _SEED) & _MASK64

    def root_key(self, namespace: str) -> int:
        """Start of the key chain for a namespace: distinct namespaces start distinct chains."""
        return self._hash(_NS_PREFIX + namespace.encode("utf-8"))

    def next_key(self, parent_key: int, page: bytes) -> int:
        """The key of a page (its tokens as int32 LE bytes) under the page keyed `parent_key`."""
        return self._hash(parent_key.to_bytes(8, "little") + page)

    def _page_keys(self, parent_key: int, token_bytes: bytes) -> list[int]:
        keys = []
        pb = self._page_bytes
        for off in range(0, len(token_bytes), pb):
            parent_key = self._hash(parent_key.to_bytes(8, "little") + token_bytes[off : off + pb])
            keys.append(parent_key)
        return keys

    def _parent_key(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None
        return self.root_key(node.namespace) if parent is self.root else parent.keys[-1]

    # ---- tree surgery ----

    def _new_root(self) -> TreeNode:
        return TreeNode(id=next(self._ids), parent=None, namespace="", token_bytes=b"", pages=[], keys=[])

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after its first n pages and return the new upper node.

        `node` keeps the tail, its children, its heap entries and its identity, so a caller holding it (locked)
        still holds the whole path; the upper node inherits the same lock_ref since every lock below passes it.
        """
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        cut = n * self._page_bytes
        upper = TreeNode(
            id=next(self._ids),
            parent=parent,
            namespace=node.namespace,
            token_bytes=node.token_bytes[:cut],
            pages=node.pages[:n],
            keys=node.keys[:n],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hits=node.hits,  # every hit on the tail passed through the head
            priority=node.priority,  # a retained path is retained whole
            retain_until=node.retain_until,
            retain_s=node.retain_s,
            retain_tenant=node.retain_tenant,
        )
        upper.children[node.keys[n]] = node
        parent.children[node.keys[0]] = upper
        node.token_bytes = node.token_bytes[cut:]
        node.pages = node.pages[n:]
        node.keys = node.keys[n:]
        node.parent = upper
        self._num_nodes += 1
        self.order.split(upper, self._num_nodes)
        return upper

    def _push_leaf(self, node: TreeNode) -> None:
        self.order.push_leaf(node, self._num_nodes)

    def _nodes(self) -> list[TreeNode]:
        """All nodes but the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---- public API ----

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached full-page prefix of `tokens`, at most (len(tokens)-1)//page_size pages; touches the path."""
        ps, pb = self.page_size, self._page_bytes
        n_pages = max(0, (len(tokens) - 1) // ps)
        if n_pages == 0:
            return MatchResult(self.root, [], 0)
        tb = as_bytes(tokens[: n_pages * ps])
        self._clock += 1
        now, wall = self._clock, self.now()
        self.order.expire(wall)
        node, key, pos = self.root, self.root_key(namespace), 0
        pages: list[int] = []
        while pos < n_pages:
            child = node.children.get(self._hash(key.to_bytes(8, "little") + tb[pos * pb : (pos + 1) * pb]))
            if child is None or (node is self.root and child.namespace != namespace):
                break
            m = min(len(child.pages), n_pages - pos)
            query = tb[pos * pb : (pos + m) * pb]
            # Equal tokens under an equal first key imply equal keys for the whole run: no need to hash the rest.
            n = m if query == child.token_bytes[: m * pb] else first_diff_page(query, child.token_bytes[: m * pb], ps)
            if n == 0:  # hash collision: another prompt's page under our key
                break
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            self.order.refresh(child, wall, self._num_nodes)
            pages.extend(child.pages)
            node, key, pos = child, child.keys[-1], pos + n
            if n < m:
                break
        if node is not self.root and not node.children:
            self._push_leaf(node)
        return MatchResult(node, pages, len(pages) * ps)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: str = "") -> InsertResult:
        """Add full pages of `tokens` (len == len(pages) * page_size); free the caller's duplicates of tree pages.

        Returns the tree's pages for the leading run it now holds; a hash collision stops the insert early and the
        caller keeps owning pages[len(result.pages):].
        """
        ps, pb = self.page_size, self._page_bytes
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert needs full pages: {len(tokens)} tokens for {len(pages)} pages of {ps}")
        n_pages = len(pages)
        if n_pages == 0:
            return InsertResult(self.root, [])
        tb = as_bytes(tokens)
        self._clock += 1
        now = self._clock
        node, key, pos = self.root, self.root_key(namespace), 0
        out: list[int] = []
        duplicates: list[int] = []
        while pos < n_pages:
            first_key = self._hash(key.to_bytes(8, "little") + tb[pos * pb : (pos + 1) * pb])
            child = node.children.get(first_key)
            if child is None:
                rest = tb[pos * pb :]
                keys = [first_key] + self._page_keys(first_key, rest[pb:])
                leaf = TreeNode(
                    id=next(self._ids),
                    parent=node,
                    namespace=namespace,
                    token_bytes=rest,
                    pages=[int(p) for p in pages[pos:]],
                    keys=keys,
                    last_access=now,
                )
                node.children[first_key] = leaf
                if self.index is not None:
                    self.index.add_run(
                        namespace,
                        None if node is self.root else node.pages[-1],
                        leaf.pages,
                        np.frombuffer(rest, dtype="<i4").tolist(),
                    )
                self._num_nodes += 1
                self._evictable += len(leaf.pages)
                out.extend(leaf.pages)
                node = leaf
                break
            if node is self.root and child.namespace != namespace:
                break
            m = min(len(child.pages), n_pages - pos)
            query = tb[pos * pb : (pos + m) * pb]
            n = m if query == child.token_bytes[: m * pb] else first_diff_page(query, child.token_bytes[: m * pb], ps)
            if n == 0:  # hash collision: stop, the caller keeps the rest
                break
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            for mine, tree in zip(pages[pos : pos + n], child.pages):
                if mine != tree:
                    duplicates.append(mine)
            out.extend(child.pages)
            node, key, pos = child, child.keys[-1], pos + n
        if duplicates:
            self.pool.free(duplicates)
        if node is not self.root and not node.children:
            self._push_leaf(node)
        return InsertResult(node, out)

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (lock_ref += 1 up to, not including, the root)."""
        if node is not self.root and node.parent is None:
            raise RuntimeError("lock() on a node that was evicted")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one lock(); raises if a lock count would go negative."""
        if node is not self.root and node.parent is None:
            raise RuntimeError("unlock() on a node that was evicted")
        n: TreeNode | None = node
        while n is not self.root:
            assert n is not None
            if n.lock_ref <= 0:
                raise RuntimeError("unlock() without a matching lock(): lock_ref would go negative")
            n = n.parent
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
                if not node.children:
                    self._push_leaf(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unlocked leaves, lowest retention priority first (plain LRU leaves
        before retained ones), least recently used first within a priority; returns pages freed.

        A leaf longer than needed loses only its tail pages, so the rest of the prefix stays cached. Every page
        evicted is spilled to the tier first (with one, a retained prefix that expired is written down, not lost).
        """
        freed: list[int] = []
        self.order.expire(self.now())
        while len(freed) < num_pages:
            node = self.order.pop_leaf()
            if node is None:
                break
            need = num_pages - len(freed)
            if need < len(node.pages):
                freed.extend(self._cut_tail(node, need))
                break
            if self.tier is not None:
                self.tier.spill(self, node, 0)
            self.order.release(node, len(node.pages), whole=True)
            freed.extend(node.pages)
            if self.index is not None:
                self.index.remove(node.pages)
            parent = node.parent
            del parent.children[node.keys[0]]  # type: ignore[union-attr]
            node.parent = None
            self._num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push_leaf(parent)
        self._evictable -= len(freed)
        self.pool.free(freed)
        return len(freed)

    def _cut_tail(self, node: TreeNode, need: int) -> list[int]:
        """Evict the last `need` pages of a leaf that holds more: the rest of its prefix stays cached."""
        cut = len(node.pages) - need
        if self.tier is not None:
            self.tier.spill(self, node, cut)
        self.order.release(node, need, whole=False)
        tail = node.pages[cut:]
        if self.index is not None:
            self.index.remove(tail)
        node.pages, node.keys = node.pages[:cut], node.keys[:cut]
        node.token_bytes = node.token_bytes[: cut * self._page_bytes]
        self._push_leaf(node)
        return tail

    def peek(self, tokens: Sequence[int], namespace: str = "") -> list[tuple[TreeNode, int]]:
        """Read-only match_prefix over all full pages of `tokens`, from any thread (tree_peek.py)."""
        return peek_path(self, tokens, namespace)

    def retain(self, node: TreeNode, retention: Retention) -> bool:
        """Retain the path ending at `node` (its pages and every ancestor's) under `retention`, locked or not; False if
        that is over the retention budget (nothing changes)."""
        if node is not self.root and node.parent is None:
            raise RuntimeError("retain() on a node that was evicted")
        now = self.now()
        self.order.expire(now)
        return node is not self.root and self.order.retain(node, retention, now, self._num_nodes)

    @property
    def retained_pages(self) -> int:
        """Pages whose retention has not decayed (it decays when the cache next matches, retains or evicts)."""
        return self.order.retained_pages

    @property
    def evictable_pages(self) -> int:
        """Pages in nodes with lock_ref == 0."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes."""
        return self._protected

    @property
    def total_pages(self) -> int:
        """All pages held by the tree."""
        return self._evictable + self._protected

    def reset(self) -> None:
        """Drop every node and free its pages; raises if any node is locked."""
        nodes = self._nodes()
        if any(n.lock_ref for n in nodes):
            raise RuntimeError("reset() while some node is locked")
        self.pool.free([p for n in nodes for p in n.pages])
        for n in nodes:
            n.parent = None
        self.root.children = {}  # the same root object: a request holding it (nothing matched) stays valid
        if self.index is not None:
            self.index.clear()
        self.order.clear()
        self._num_nodes = self._evictable = self._protected = 0

    def flush_namespaces(self, accept: Callable[[str], bool]) -> int:
        """Drop the unlocked pages of every namespace `accept` takes (what running requests lock stays, and every
        other namespace is untouched); returns the pages freed."""
        freed: list[int] = []
        stack = [c for c in self.root.children.values() if accept(c.namespace)]
        while stack:
            node = stack.pop()
            if node.lock_ref:  # a running request's path: keep it, look below it
                stack.extend(node.children.values())
                continue
            # Unlocked, so is all below it (a lock counts on every ancestor): the whole subtree goes.
            del node.parent.children[node.keys[0]]  # type: ignore[union-attr]
            sub = [node]
            while sub:
                n = sub.pop()
                sub.extend(n.children.values())
                freed.extend(n.pages)
                self.order.release(n, len(n.pages), whole=True)
                if self.index is not None:
                    self.index.remove(n.pages)
                n.parent, n.children = None, {}
                self._num_nodes -= 1
        self._evictable -= len(freed)
        self.pool.free(freed)
        return len(freed)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken rule of the tree (radixserve/cache/tree_check.py)."""
        check_tree(self)
