"""The radix cache's nodes and results: a node holds a run of full pages with their chained keys and tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False, slots=True)
class TreeNode:
    """A run of full pages: `keys[i]`, `pages[i]` and tokens `token_bytes[i*page_bytes:(i+1)*page_bytes]` per page."""

    id: int
    parent: TreeNode | None
    namespace: str
    token_bytes: bytes  # int32 little-endian, len(pages) * page_size tokens
    pages: list[int]
    keys: list[int]
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0  # requests admitted onto a path through this node (counted by radixserve/timeline.py)
    # Retention (radixserve/cache/retention.py): 0 is plain LRU; while retained, evicted after every plain leaf
    priority: int = 0
    retain_until: float = 0.0  # the cache's clock (monotonic seconds) at which retention decays to LRU
    retain_s: float = 0.0  # how long a hit extends it
    retain_tenant: str = ""  # whose retention budget the node's pages count against
    children: dict[int, TreeNode] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        """The node's tokens as Python ints (for debugging and tests; the hot path works on bytes)."""
        return np.frombuffer(self.token_bytes, dtype="<i4").tolist()


@dataclass
class MatchResult:
    node: TreeNode  # deepest node matched (root if nothing); pass to lock()/unlock()
    pages: list[int]  # pool page ids of the matched full pages, in order
    num_tokens: int  # len(pages) * page_size


@dataclass
class InsertResult:
    node: TreeNode  # deepest node now holding the inserted run (lock it)
    pages: list[int]  # the tree's page ids for the first len(pages) pages of the run; shorter only on a hash collision


def as_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def first_diff_page(a: bytes, b: bytes, page_size: int) -> int:
    """Index of the first page where two equal-length token byte strings differ (they must differ somewhere)."""
    x = np.frombuffer(a, dtype="<i4")
    y = np.frombuffer(b, dtype="<i4")
    return int(np.flatnonzero(x != y)[0]) // page_size
