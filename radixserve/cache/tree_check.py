"""The radix tree's invariants, checked by a full walk (tests and `Engine.check_invariants`; never on the serving
path): structure, chained page keys, namespaces, lock counts, eviction and expiry heap membership, retained pages, page ownership and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache


def check_tree(cache: RadixCache) -> None:
    """Raise AssertionError naming the first broken rule of the tree."""
    root = cache.root
    assert root.parent is None and not root.pages and not root.keys, "root holds no pages"
    assert root.lock_ref == 0, "root lock_ref stays 0 (root is never counted)"
    pb = cache._page_bytes
    seen: set[int] = set()
    evictable = protected = 0
    order = cache.order
    in_heap = {(n.id, prio, la) for prio, la, _, n in order.leaves}
    in_expiry = {(n.id, until) for until, _, n in order.expiry}
    in_tenant = {(t, n.id, until) for t, heap in order.tenant_expiry.items() for until, _, n in heap}
    retained = retained_nodes = 0
    by_tenant: dict[str, int] = {}
    nodes = cache._nodes()
    assert len(nodes) == cache._num_nodes, f"node count {cache._num_nodes} matches a recount {len(nodes)}"
    for node in nodes:
        parent = node.parent
        assert parent is not None, "every node in the tree has a parent"
        assert len(node.pages) > 0, "a node holds at least one page"
        assert len(node.keys) == len(node.pages), "one key per page"
        assert len(node.token_bytes) == len(node.pages) * pb, "page_size tokens per page"
        assert parent.children.get(node.keys[0]) is node, "children dict key equals the child's first page key"
        if parent is not root:
            assert node.namespace == parent.namespace, "a node's namespace equals its parent's"
        assert cache._page_keys(cache._parent_key(node), node.token_bytes) == node.keys, (
            "page key = hash(parent key, page tokens), chained from the namespace root key"
        )
        assert node.lock_ref >= 0, "lock_ref >= 0"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
            "a node's lock_ref >= the sum of its children's (every lock below passes through it)"
        )
        assert parent is root or parent.last_access >= node.last_access, "a parent is touched whenever a child is"
        for p in node.pages:
            assert p not in seen, f"page {p} appears twice in the tree"
            seen.add(p)
            assert 0 < p < cache.pool.num_pages, f"page {p} is a valid, non-sink page id"
            assert not cache.pool.is_free(p), f"tree page {p} is not in the pool's free list"
        if node.lock_ref:
            protected += len(node.pages)
        else:
            evictable += len(node.pages)
            if not node.children:
                assert (node.id, node.priority, node.last_access) in in_heap, (
                    "every unlocked leaf is in the eviction heap"
                )
        if node.priority:
            assert (node.id, node.retain_until) in in_expiry, "every retained node is in the expiry heap"
            assert (node.retain_tenant, node.id, node.retain_until) in in_tenant, "and in its tenant's expiry heap"
            retained += len(node.pages)
            retained_nodes += 1
            by_tenant[node.retain_tenant] = by_tenant.get(node.retain_tenant, 0) + len(node.pages)
    assert evictable == cache._evictable, f"evictable_pages {cache._evictable} matches a recount {evictable}"
    assert protected == cache._protected, f"protected_pages {cache._protected} matches a recount {protected}"
    assert retained == order.retained_pages, f"retained_pages {order.retained_pages} matches a recount {retained}"
    assert retained_nodes == order.retained_nodes, "retained_nodes matches a recount"
    assert by_tenant == dict(order.by_tenant), "retained pages per tenant match a recount"
    assert cache.total_pages == len(seen), "total_pages equals the pages held by the tree"
    if cache.index is not None:
        assert cache.index.pages() == seen, "the continuation index holds exactly the tree's pages"
