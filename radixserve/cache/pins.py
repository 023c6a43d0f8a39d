"""Pinned prefixes: a pin is one extra lock on the tree node ending a prompt's full pages, so eviction never takes
them, up to a share of the pool. Pins live in memory (a restart forgets them; the disk tier keeps their pages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.radix_cache import RadixCache, TreeNode


class PinError(ValueError):
    """The pin cannot be made (the message says why)."""


@dataclass
class Pin:
    node: TreeNode
    num_pages: int


class PinTable:
    def __init__(self, max_share: float) -> None:
        self.max_share = max_share
        self.pins: dict[tuple[str, bytes], Pin] = {}
        self.num_pinned = 0  # len(pinned_pages()), kept current: a locked path neither splits away nor evicts

    @staticmethod
    def _full_pages(cache: RadixCache, tokens: Sequence[int], namespace: str) -> tuple[str, bytes]:
        n = len(tokens) // cache.page_size * cache.page_size
        return namespace, np.asarray(tokens[:n], dtype="<i4").tobytes()

    def pin(self, cache: RadixCache, tokens: Sequence[int], namespace: str) -> int:
        """Pin the cached full pages of `tokens` (they must be in the tree); returns the pages pinned."""
        key = self._full_pages(cache, tokens, namespace)
        if key in self.pins:
            return self.pins[key].num_pages
        n_pages = len(key[1]) // (4 * cache.page_size)
        if n_pages == 0:
            raise PinError(f"the prompt is shorter than one page ({cache.page_size} tokens): nothing to pin")
        m = cache.match_prefix(list(tokens[: n_pages * cache.page_size]) + [0], namespace)  # +1: all full pages
        if len(m.pages) < n_pages:
            raise PinError("the prompt's pages are not all cached (evicted meanwhile); try again")
        limit = int(self.max_share * cache.pool.capacity)
        total = len(self.pinned_pages(cache) | set(m.pages))
        if total > limit:
            raise PinError(
                f"pinning {n_pages} pages would hold {total} pinned pages, over the limit of {limit} "
                f"(max_pinned_share {self.max_share} of {cache.pool.capacity})"
            )
        cache.lock(m.node)
        self.pins[key] = Pin(m.node, n_pages)
        self.num_pinned = total
        return n_pages

    def unpin(self, cache: RadixCache, tokens: Sequence[int], namespace: str) -> bool:
        pin = self.pins.pop(self._full_pages(cache, tokens, namespace), None)
        if pin is None:
            return False
        cache.unlock(pin.node)
        self.num_pinned = len(self.pinned_pages(cache))
        return True

    def clear(self, cache: RadixCache) -> None:
        for pin in self.pins.values():
            cache.unlock(pin.node)
        self.pins.clear()
        self.num_pinned = 0

    def pinned_pages(self, cache: RadixCache) -> set[int]:
        """Pool pages pinned (the union over every pin's path)."""
        out: set[int] = set()
        for pin in self.pins.values():
            node: TreeNode | None = pin.node
            while node is not None and node is not cache.root:
                out.update(node.pages)
                node = node.parent
        return out
