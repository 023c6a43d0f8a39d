"""Token-granular reuse below the page size: the partial pages the radix tree remembers after its full pages.

The radix tree keys full pages only. After the last full page of a prefix, the request that computed it usually
holds a partly filled page: the tail. `PartialPages` remembers such tails by the key of the full page they follow
(the namespace's root key when they start the sequence), so that a later request whose prompt continues into a tail
copies the rows of KV it matches into a page of its own instead of computing them again (copy-on-write: the reader
never writes the shared page, and never reads its rows past the matched tokens).

A tail lives in one of two states (docs/DESIGN.md, "Partial pages"):
- live: the page is the private partial page of a running request (its `owner`), which may keep writing it past the
  tokens recorded here; the scheduler updates the record after each processed prefill chunk and ends it (`release`)
  when the owner lets go of the page.
- kept: at the owner's end the page passes to this registry, which holds it (it counts as cached and evictable) until
  it is evicted, least recently used first, before any full page of the tree.

A tail is valid while the tree node it follows still ends at the same page key: eviction may drop or shorten that
node, and a tail found stale is dropped (its page freed if kept).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import TreeNode

# Tails kept per boundary key: a few distinct continuations of one prefix (forks) are worth a page each; past that the
# oldest makes room (a tail saves less than one page of compute, so it never outweighs a full page).
MAX_TAILS_PER_KEY = 4


@dataclass(eq=False, slots=True)
class PartialTail:
    """`token_bytes` (int32 LE, 1..page_size-1 tokens) follow the full page keyed `key`; their KV is in `page`."""

    key: int
    node: TreeNode  # the node whose last page is keyed `key` (the root for a tail at the start of the sequence)
    namespace: str
    token_bytes: bytes
    page: int
    owner: Any  # the running request whose private page it is (live), None once the registry holds it (kept)
    used: int = 0  # the registry's clock at its last hit or keep: the least recently used goes first


@dataclass(frozen=True, slots=True)
class PartialHit:
    page: int  # the page to copy from
    num_tokens: int  # rows 0..num_tokens-1 match the prompt; only they are copied


class PartialPages:
    """Tails by boundary key, and the kept ones in LRU order. Every method runs on the scheduler's thread."""

    def __init__(self, pool: KVPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._by_key: dict[int, list[PartialTail]] = {}
        self._kept: OrderedDict[int, PartialTail] = OrderedDict()  # id(tail) -> tail, least recently used first
        self._clock = 0

    @property
    def kept_pages(self) -> int:
        """Pages the registry holds (kept tails): cached, and evictable at any time."""
        return len(self._kept)

    # ---- live tails (the owner's private page) -----------------------------------------------------------------
    def note(
        self,
        tail: PartialTail | None,
        key: int,
        node: TreeNode,
        namespace: str,
        token_bytes: bytes,
        page: int,
        owner: Any,
    ) -> PartialTail | None:
        """Record (or update) the live tail of `owner`: `token_bytes` of KV computed in `page` after the page keyed
        `key`. Returns the owner's record now (None when there is no tail to record)."""
        if tail is not None and (tail.key != key or tail.page != page or tail.node is not node):
            self.release(tail, keep=False)
            tail = None
        if not token_bytes:
            if tail is not None:
                self.release(tail, keep=False)
            return None
        if tail is None:
            tail = PartialTail(key, node, namespace, token_bytes, page, owner)
            self._by_key.setdefault(key, []).append(tail)
        else:
            tail.token_bytes = token_bytes
        return tail

    def release(self, tail: PartialTail, keep: bool) -> bool:
        """The owner lets go of its page. With `keep`, the registry takes the page over (True) unless a kept tail
        already covers these tokens; otherwise the record ends and the owner frees the page (False)."""
        self._remove(tail)
        tail.owner = None
        kept = [t for t in self._by_key.get(tail.key, ()) if t.owner is None]
        if not keep or not self._valid(tail) or any(self._covers(t, tail) for t in kept):
            return False
        for old in kept:
            if self._covers(tail, old):
                self._drop(old)  # the new tail extends it
        tails = self._by_key.setdefault(tail.key, [])
        tails.append(tail)
        self._kept[id(tail)] = tail
        self._touch(tail)
        kept = sorted((t for t in tails if t.owner is None), key=lambda t: t.used)
        for old in kept[: max(0, len(kept) - MAX_TAILS_PER_KEY)]:
            self._drop(old)
        return True

    # ---- lookup --------------------------------------------------------------------------------------------------
    def lookup(self, node: TreeNode, key: int, namespace: str, query: bytes, is_root: bool) -> PartialHit | None:
        """The source with the longest run of `query`'s tokens (int32 LE, the prompt after the boundary, already cut
        to the most tokens that may be reused): a tail at `key`, or the first page of one of `node`'s children (a full
        page of the tree that the prompt leaves part way, or that it may not take whole since one token must be
        computed)."""
        best: PartialHit | None = None
        for tail in list(self._by_key.get(key, ())):
            if tail.node is not node or tail.namespace != namespace:
                continue  # another prefix (or namespace) under the same key: a hash collision
            if not self._valid(tail):
                self._drop_stale(tail)
                continue
            n = _common_tokens(query, tail.token_bytes)
            if n and (best is None or n > best.num_tokens):
                best = PartialHit(tail.page, n)
                if tail.owner is None:
                    self._touch(tail)
        pb = 4 * self.page_size
        first = query[:4]
        for child in node.children.values():
            # (the first-token test is a cheap filter: the root may have thousands of children)
            if not child.token_bytes.startswith(first) or (is_root and child.namespace != namespace):
                continue
            n = _common_tokens(query, child.token_bytes[:pb])
            if n and (best is None or n > best.num_tokens):
                best = PartialHit(child.pages[0], n)
        return best

    # ---- eviction and reset --------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` kept tails, least recently used first; returns pages freed."""
        freed = 0
        while freed < num_pages and self._kept:
            self._drop(next(iter(self._kept.values())))
            freed += 1
        return freed

    def reset(self) -> None:
        """Free every kept tail and forget the live ones (the caller ensures no request runs)."""
        self.pool.free([t.page for t in self._kept.values()])
        self._kept.clear()
        self._by_key.clear()

    def check_invariants(self) -> None:
        kept = [t for ts in self._by_key.values() for t in ts if t.owner is None]
        assert {id(t) for t in kept} == set(self._kept), "every kept tail is in the LRU, and only those"
        pages = [t.page for t in kept]
        assert len(pages) == len(set(pages)), "a page is kept twice"
        for tail in (t for ts in self._by_key.values() for t in ts):
            n = len(tail.token_bytes) // 4
            assert 0 < n < self.page_size, f"a tail holds 1..page_size-1 tokens, not {n}"
            assert not self.pool.is_free(tail.page), f"tail page {tail.page} is not free"
            if tail.owner is not None:
                owner_pages = tail.owner.pages
                assert tail.page in owner_pages[tail.owner.num_tree_pages :], "a live tail's page is its owner's"

    # ---- internals -----------------------------------------------------------------------------------------------
    def _touch(self, tail: PartialTail) -> None:
        self._clock += 1
        tail.used = self._clock
        self._kept.move_to_end(id(tail))

    def _valid(self, tail: PartialTail) -> bool:
        node = tail.node
        if node.parent is None and node.keys:  # evicted (the root has no keys and no parent)
            return False
        return not node.keys or node.keys[-1] == tail.key

    @staticmethod
    def _covers(a: PartialTail, b: PartialTail) -> bool:
        """Whether a's tokens start with all of b's (a serves every prompt b serves)."""
        return a.node is b.node and a.namespace == b.namespace and a.token_bytes.startswith(b.token_bytes)

    def _remove(self, tail: PartialTail) -> None:
        tails = self._by_key[tail.key]
        tails.remove(tail)
        if not tails:
            del self._by_key[tail.key]

    def _drop(self, tail: PartialTail) -> None:
        """Forget a kept tail and free its page."""
        del self._kept[id(tail)]
        self._remove(tail)
        self.pool.free([tail.page])

    def _drop_stale(self, tail: PartialTail) -> None:
        if tail.owner is None:
            self._drop(tail)
        # A live tail cannot go stale: its owner holds a lock on its node, which keeps the node whole.


def _common_tokens(a: bytes, b: bytes) -> int:
    """Number of leading int32 tokens two byte strings share."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype="<i4", count=n)
    y = np.frombuffer(b, dtype="<i4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
