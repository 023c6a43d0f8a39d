"""The radix tree read without touching it: the path a prompt would match, for any thread (the dashboard's "why did
this miss"), with no split, no lock and no change to any node's last access or retention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.cache.tree_node import TreeNode, as_bytes, first_diff_page

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache


def peek_path(cache: RadixCache, tokens: Sequence[int], namespace: str = "") -> list[tuple[TreeNode, int]]:
    """Read-only match_prefix over all full pages of `tokens`: the path as (node, pages matched in it).

    Touches, splits and locks nothing, so any thread may call it (the dashboard's "why did this miss"); a
    concurrent change can make the answer stale, never wrong for the tree it saw."""
    ps, pb = cache.page_size, cache._page_bytes
    n_pages = len(tokens) // ps
    tb = as_bytes(tokens[: n_pages * ps])
    node, key, pos = cache.root, cache.root_key(namespace), 0
    path: list[tuple[TreeNode, int]] = []
    while pos < n_pages:
        child = node.children.get(cache._hash(key.to_bytes(8, "little") + tb[pos * pb : (pos + 1) * pb]))
        if child is None or (node is cache.root and child.namespace != namespace):
            break
        held = child.token_bytes
        m = min(len(held) // pb, n_pages - pos)
        query = tb[pos * pb : (pos + m) * pb]
        n = m if query == held[: m * pb] else first_diff_page(query, held[: m * pb], ps)
        if n == 0:
            break
        path.append((child, n))
        if n < len(held) // pb:
            break
        node, key, pos = child, child.keys[n - 1], pos + n
    return path
