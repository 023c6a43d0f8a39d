"""The radix tree's eviction order: unlocked leaves by (retention priority, last access), and retention's expiry.

A retained node keeps `priority` (1..100; 0 is plain LRU) until `retain_until`; eviction pops the leaf heap's least
(priority, last_access), so every plain leaf goes before any retained one, and among retained leaves the lower
priority goes first. Expiry is a second heap keyed by `retain_until`: `expire(now)` pops what has run out and puts
it back among plain leaves (retention decays to LRU, it never forces an eviction). Both heaps drop stale entries
lazily (an entry is current while the node still has the key it was pushed with), so every change is one push and
every eviction one pop: O(log n), never a scan.

Retention is bounded: retained pages stay within a share of the pool, and each tenant's within its own share, so
no tenant can retain the pool away from the others. A tenant at its share makes room by decaying its own retentions
that expire soonest (its newest hints win over its stale ones; another tenant's are never touched); a retention that
would not fit even so, or that would go over the pool's share, is refused (it is a hint).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.cache.tree_node import TreeNode

MAX_PRIORITY = 100
DEFAULT_PRIORITY = 50
MAX_RETENTION_S = 24 * 3600.0  # OpenAI's longest (prompt_cache_retention "24h")


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep a prefix out of LRU eviction for `seconds` after its last hit, ahead of plain leaves and of retained
    ones with a lower `priority`; `tenant` is whose budget it counts against."""

    seconds: float
    priority: int = DEFAULT_PRIORITY
    tenant: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= MAX_RETENTION_S:
            raise ValueError(f"retention seconds must be in (0, {MAX_RETENTION_S:g}], got {self.seconds!r}")
        if not 1 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"retention priority must be in [1, {MAX_PRIORITY}], got {self.priority!r}")


@dataclass
class RetentionStats:
    retained: int = 0  # retentions made (each request or call that retained a path)
    refused: int = 0  # retentions over the pool's or the tenant's share
    expired_nodes: int = 0  # nodes whose retention ran out and decayed to LRU
    displaced_nodes: int = 0  # nodes decayed early to make room for a newer retention of the same tenant


class EvictionOrder:
    """The leaf heap, the expiry heap and the retained-page counts of one RadixCache (which calls every hook)."""

    def __init__(self, max_pages: int, max_pages_per_tenant: int) -> None:
        self.max_pages = max_pages
        self.max_pages_per_tenant = max_pages_per_tenant
        self.leaves: list[tuple[int, int, int, TreeNode]] = []  # (priority, last_access, id, leaf)
        self.expiry: list[tuple[float, int, TreeNode]] = []  # (retain_until, id, retained node)
        self.tenant_expiry: dict[str, list[tuple[float, int, TreeNode]]] = defaultdict(list)  # the same, per tenant
        self.retained_pages = 0
        self.retained_nodes = 0
        self.by_tenant: dict[str, int] = defaultdict(int)  # retained pages per tenant
        self.stats = RetentionStats()

    # ---- the leaf heap ----

    def push_leaf(self, node: TreeNode, num_nodes: int) -> None:
        heapq.heappush(self.leaves, (node.priority, node.last_access, node.id, node))
        if len(self.leaves) > 4 * num_nodes + 64:  # stale entries pile up under hot leaves: compact
            self.rebuild(n for n in self._live(self.leaves) if not n.children and n.lock_ref == 0)

    def pop_leaf(self) -> TreeNode | None:
        """The next leaf to evict (unlocked, childless, its entry current), or None when there is none."""
        heap = self.leaves
        while heap:
            priority, last_access, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref:
                continue
            if node.priority != priority or node.last_access != last_access:
                continue  # touched or re-prioritised since: a newer entry stands for it
            return node
        return None

    def rebuild(self, leaves: Iterable[TreeNode]) -> None:
        self.leaves = [(n.priority, n.last_access, n.id, n) for n in leaves]
        heapq.heapify(self.leaves)

    @staticmethod
    def _live(heap: list) -> list[TreeNode]:  # type: ignore[type-arg]
        seen: dict[int, TreeNode] = {}
        for entry in heap:
            node = entry[-1]
            if node.parent is not None:
                seen[node.id] = node
        return list(seen.values())

    # ---- retention ----

    def retain(self, node: TreeNode, r: Retention, now: float, num_nodes: int) -> bool:
        """Retain `node` and every ancestor below the root under `r`; False (nothing changes) if the pages it newly
        retains would go over the pool's or the tenant's share."""
        path = []
        while node.parent is not None:  # the root alone has no parent
            path.append(node)
            node = node.parent
        new = sum(len(n.pages) for n in path if n.priority == 0)
        mine = sum(len(n.pages) for n in path if n.priority and n.retain_tenant == r.tenant)  # cannot make room
        over = self.by_tenant.get(r.tenant, 0) + new - self.max_pages_per_tenant  # pages to displace
        if new and (
            mine + new > self.max_pages_per_tenant or self.retained_pages - max(over, 0) + new > self.max_pages
        ):
            self.stats.refused += 1
            return False
        if new and over > 0:
            self._displace(r.tenant, over, {n.id for n in path}, num_nodes)
        until = now + r.seconds
        for node in path:
            if node.priority == 0:
                node.retain_tenant = r.tenant
                self._count(node, len(node.pages), 1)
            elif node.priority >= r.priority and node.retain_until >= until:
                continue
            node.priority = max(node.priority, r.priority)
            node.retain_s = max(node.retain_s, r.seconds)
            self._extend(node, max(node.retain_until, until), num_nodes)
            if not node.children and node.lock_ref == 0:
                self.push_leaf(node, num_nodes)
        self.stats.retained += 1
        return True

    def refresh(self, node: TreeNode, now: float, num_nodes: int) -> None:
        """A hit on a retained node: its retention runs again from now (an expired one has decayed already)."""
        if node.priority and node.retain_until < now + node.retain_s:
            self._extend(node, now + node.retain_s, num_nodes)

    def expire(self, now: float) -> None:
        """Decay every retention that has run out to plain LRU."""
        heap = self.expiry
        while heap and heap[0][0] <= now:
            until, _, node = heapq.heappop(heap)
            if node.parent is None or node.priority == 0 or node.retain_until != until:
                continue  # evicted, decayed, or refreshed since
            self._decay(node)
            self.stats.expired_nodes += 1

    def _displace(self, tenant: str, pages: int, keep: set[int], num_nodes: int) -> None:
        """Decay the tenant's retained nodes that expire soonest, none of `keep`, until `pages` pages are free."""
        heap, kept = self.tenant_expiry[tenant], []
        while pages > 0 and heap:
            entry = heapq.heappop(heap)
            until, _, node = entry
            if node.parent is None or not node.priority or node.retain_until != until or node.retain_tenant != tenant:
                continue  # evicted, decayed, refreshed or retained anew since
            if node.id in keep:
                kept.append(entry)
                continue
            pages -= len(node.pages)
            self._decay(node)
            self.stats.displaced_nodes += 1
        for entry in kept:
            heapq.heappush(heap, entry)

    def _decay(self, node: TreeNode) -> None:
        self.release(node, len(node.pages), whole=True)
        node.priority, node.retain_until, node.retain_s = 0, 0.0, 0.0
        if not node.children and node.lock_ref == 0:
            heapq.heappush(self.leaves, (0, node.last_access, node.id, node))

    def release(self, node: TreeNode, num_pages: int, whole: bool) -> None:
        """`num_pages` of a node leave retention: its tail pages evicted, or the whole node (evicted, flushed or
        decayed)."""
        if node.priority:
            self._count(node, -num_pages, -1 if whole else 0)

    def split(self, upper: TreeNode, num_nodes: int) -> None:
        """`upper` was cut from a retained node: it keeps the retention (the counts move with the pages)."""
        if upper.priority:
            self.retained_nodes += 1
            heapq.heappush(self.expiry, (upper.retain_until, upper.id, upper))
            heapq.heappush(self.tenant_expiry[upper.retain_tenant], (upper.retain_until, upper.id, upper))

    def clear(self) -> None:
        self.leaves, self.expiry = [], []
        self.tenant_expiry.clear()
        self.retained_pages = self.retained_nodes = 0
        self.by_tenant.clear()

    def _count(self, node: TreeNode, pages: int, nodes: int) -> None:
        self.retained_pages += pages
        self.retained_nodes += nodes
        self.by_tenant[node.retain_tenant] += pages
        if self.by_tenant[node.retain_tenant] == 0:
            del self.by_tenant[node.retain_tenant]

    def _extend(self, node: TreeNode, until: float, num_nodes: int) -> None:
        node.retain_until = until
        heapq.heappush(self.expiry, (until, node.id, node))
        heapq.heappush(self.tenant_expiry[node.retain_tenant], (until, node.id, node))
        if len(self.expiry) > 4 * num_nodes + 64:  # hits refresh hot prefixes often: compact
            live = [n for n in self._live(self.expiry) if n.priority]
            self.expiry = [(n.retain_until, n.id, n) for n in live]
            heapq.heapify(self.expiry)
            self.tenant_expiry.clear()
            for n in live:
                self.tenant_expiry[n.retain_tenant].append((n.retain_until, n.id, n))
            for heap in self.tenant_expiry.values():
                heapq.heapify(heap)
