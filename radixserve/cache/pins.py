"""Pinned prefixes: a pin is one extra lock on the tree node ending a prompt's full pages, so eviction never takes
them, up to a share of the pool. With a disk tier every change is saved beside its index (`on_change`), and the next
start loads the pinned pages back and pins them again (`restore`), within the share of the pool it has then."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tree_node import TreeNode, as_bytes

log = logging.getLogger(__name__)


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
        self.on_change: Callable[[list[tuple[str, list[int]]]], None] | None = None  # saves entries() (disk tier)

    @staticmethod
    def _full_pages(cache: RadixCache, tokens: Sequence[int], namespace: str) -> tuple[str, bytes]:
        n = len(tokens) // cache.page_size * cache.page_size
        return namespace, as_bytes(tokens[:n])

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
        self._changed()
        return n_pages

    def unpin(self, cache: RadixCache, tokens: Sequence[int], namespace: str) -> bool:
        pin = self.pins.pop(self._full_pages(cache, tokens, namespace), None)
        if pin is None:
            return False
        cache.unlock(pin.node)
        self.num_pinned = len(self.pinned_pages(cache))
        self._changed()
        return True

    def clear(self, cache: RadixCache) -> None:
        for pin in self.pins.values():
            cache.unlock(pin.node)
        self.pins.clear()
        self.num_pinned = 0
        self._changed()

    def entries(self) -> list[tuple[str, list[int]]]:
        """Every pin as (namespace, its full-page tokens), oldest first."""
        return [(ns, np.frombuffer(tb, dtype="<i4").tolist()) for ns, tb in self.pins]

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.entries())

    def restore(self, cache: RadixCache, saved: list[tuple[str, list[int]]], load: Callable[..., int]) -> int:
        """Pin the saved prompts again, loading their pages with `load(cache, tokens, namespace)` (the tiers'
        load_prefix) first; one that cannot be pinned now (pages gone, over the share) is dropped with a warning.
        Returns the pins made."""
        made = 0
        for namespace, tokens in saved:
            load(cache, tokens + [0], namespace)  # +1 token: load_prefix, like match_prefix, leaves the last page
            try:
                self.pin(cache, tokens, namespace)
                made += 1
            except PinError as exc:
                log.warning("a pin saved by the last run is not restored: %s", exc)
        return made

    def pinned_pages(self, cache: RadixCache) -> set[int]:
        """Pool pages pinned (the union over every pin's path)."""
        out: set[int] = set()
        for pin in self.pins.values():
            node: TreeNode | None = pin.node
            while node is not None and node is not cache.root:
                out.update(node.pages)
                node = node.parent
        return out
