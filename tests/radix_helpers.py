"""A small pool and radix tree for the radix cache's tests, with colliding hash functions to force the
collision paths."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xxhash

from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache

HashFn = Callable[[bytes, int], int]


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
