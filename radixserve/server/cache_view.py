"""What the cache explorer shows, read without stopping the engine loop: a bounded snapshot of the radix tree, the
pool's occupancy, the running and waiting requests, and why a prompt's path leaves the tree.

Every reader here runs on a server thread and reads engine state lock-free: under the GIL, copying a dict's values or
a list is atomic and an int field is read whole, so a reader may see the tree between two steps' changes but never a
torn object. The work is bounded by the number of nodes shown (`max_nodes`), not by the tree's size, except that a
node with more than SCAN_CAP children is sampled.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.server.scope import NamespaceScope

PREVIEW_TOKENS = 48  # tokens of a node decoded for the page
PREVIEW_CHARS = 240
PREVIEW_MEMO = 50_000  # decoded previews remembered (then forgotten all at once)
SCAN_CAP = 4096  # children of one node examined to pick the hottest; past it, a random sample of this many
DEFAULT_NODES, MAX_NODES = 400, 5000
DEFAULT_DEPTH, MAX_DEPTH = 64, 1024


@dataclass
class NodeView:
    id: int
    key: str  # hex of the node's first page key: a path of keys names a node for `path=`
    namespace: str
    pages: int
    tokens: int
    text: str
    hits: int
    last_access: int  # the tree's logical clock
    age_s: float | None  # seconds since last access (None: older than the tracker remembers)
    lock_ref: int
    retained_s: float | None = None  # seconds of retention left (cache/retention.py); None: plain LRU
    retention_priority: int = 0
    num_children: int = 0
    hidden_children: int = 0  # children not shown (depth or node budget): the tree is collapsed there
    children: list[NodeView] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "key": self.key,
            "namespace": self.namespace,
            "pages": self.pages,
            "tokens": self.tokens,
            "text": self.text,
            "hits": self.hits,
            "last_access": self.last_access,
            "age_s": self.age_s,
            "locked": self.lock_ref > 0,
            "lock_ref": self.lock_ref,
            "retained_s": self.retained_s,
            "retention_priority": self.retention_priority,
            "num_children": self.num_children,
            "hidden_children": self.hidden_children,
            "children": [c.to_dict() for c in self.children],
        }


@dataclass
class TreeSnapshot:
    root: NodeView
    shown_nodes: int
    total_nodes: int
    total_pages: int
    page_size: int
    truncated: bool
    snapshot_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root.to_dict(),
            "shown_nodes": self.shown_nodes,
            "total_nodes": self.total_nodes,
            "total_pages": self.total_pages,
            "page_size": self.page_size,
            "truncated": self.truncated,
            "snapshot_ms": round(self.snapshot_ms, 3),
        }


class TreeReader:
    """Reads one engine's radix tree; `decode` turns token ids into text, `clock_age` a logical clock into seconds."""

    def __init__(
        self, cache: Any, page_size: int, decode: Callable[[list[int]], str], clock_age: Callable[[int], float | None]
    ) -> None:
        self.cache, self.page_size, self.decode, self.clock_age = cache, page_size, decode, clock_age
        self._previews: dict[tuple[int, int, int], str] = {}

    def _preview(self, node: Any) -> str:
        """The node's first tokens as text, remembered: decoding is most of a snapshot's cost. A node's id plus its
        first page key name its first tokens (a split gives the tail a new first key)."""
        tb = node.token_bytes
        keys = node.keys
        memo_key = (node.id, keys[0] if keys else 0, min(len(tb) // 4, PREVIEW_TOKENS))
        text = self._previews.get(memo_key)
        if text is None:
            if len(self._previews) >= PREVIEW_MEMO:
                self._previews = {}
            text = self.decode(np.frombuffer(tb[: 4 * PREVIEW_TOKENS], dtype="<i4").tolist())[:PREVIEW_CHARS]
            self._previews[memo_key] = text
        return text

    def _view(self, node: Any) -> NodeView:
        tb = node.token_bytes
        text = self._preview(node)
        keys = node.keys
        return NodeView(
            id=node.id,
            key=format(keys[0], "016x") if keys else "",
            namespace=node.namespace,
            pages=len(node.pages),
            tokens=len(tb) // 4,
            text=text,
            hits=node.hits,
            last_access=node.last_access,
            age_s=self.clock_age(node.last_access),
            lock_ref=node.lock_ref,
            **self._retention(node),
        )

    def _retention(self, node: Any) -> dict[str, Any]:
        """Retention left on the cache's clock; one that ran out but has not decayed yet (the cache decays on its next
        match, retain or eviction) shows as none."""
        left = node.retain_until - self.cache.now() if node.priority else 0.0
        return {"retained_s": round(left, 1), "retention_priority": node.priority} if left > 0 else {}

    def _children(self, node: Any, scope: NamespaceScope, namespace: str | None) -> list[Any]:
        kids = list(node.children.values())
        if node is self.cache.root:  # namespaces part at the root: a caller sees only its own subtrees
            kids = [k for k in kids if scope.allows(k.namespace) and (namespace is None or k.namespace == namespace)]
        return kids

    def find(self, path: list[str], scope: NamespaceScope) -> Any:
        """The node named by a path of first-page keys from the root; stops at the deepest one still found."""
        node = self.cache.root
        for key in path:
            child = node.children.get(int(key, 16))
            if child is None or (node is self.cache.root and not scope.allows(child.namespace)):
                break
            node = child
        return node

    def snapshot(
        self,
        scope: NamespaceScope,
        namespace: str | None = None,
        depth: int = DEFAULT_DEPTH,
        max_nodes: int = DEFAULT_NODES,
        path: list[str] | None = None,
    ) -> TreeSnapshot:
        """The tree breadth-first from the root (or the node `path` names), hottest children first, at most
        `max_nodes` nodes and `depth` levels; what is left out is counted in each node's hidden_children."""
        t0 = time.perf_counter()
        cache = self.cache
        start = self.find(path or [], scope)
        top = (
            NodeView(
                id=start.id,
                key="",
                namespace=start.namespace,
                pages=0,
                tokens=0,
                text="",
                hits=0,
                last_access=0,
                age_s=None,
                lock_ref=0,
            )
            if start is cache.root
            else self._view(start)
        )
        budget, shown, truncated = max_nodes, 0, False
        queue: deque[tuple[NodeView, Any, int]] = deque([(top, start, 0)])
        while queue:
            view, node, d = queue.popleft()
            kids = self._children(node, scope, namespace)
            view.num_children = len(kids)
            if d >= depth or budget <= 0:
                view.hidden_children = len(kids)
                truncated |= bool(kids)
                continue
            if len(kids) > SCAN_CAP:
                kids = random.sample(kids, SCAN_CAP)
            kids = sorted(kids, key=lambda k: -k.last_access)[:budget]  # the most recently used first
            budget -= len(kids)
            view.hidden_children = view.num_children - len(kids)
            truncated |= view.hidden_children > 0
            for k in kids:
                if k.parent is None or not k.pages:
                    continue  # evicted while we read
                child = self._view(k)
                view.children.append(child)
                queue.append((child, k, d + 1))
                shown += 1
        return TreeSnapshot(
            top,
            shown,
            getattr(cache, "_num_nodes", 0),
            cache.total_pages,
            self.page_size,
            truncated,
            (time.perf_counter() - t0) * 1e3,
        )

    def why_miss(self, ids: list[int], namespace: str) -> dict[str, Any]:
        """Where the path of a prompt's tokens leaves the tree, and why the rest would be computed."""
        ps = self.page_size
        limit = max(0, (len(ids) - 1) // ps) * ps  # match_prefix never serves the last token
        path = self.cache.peek(ids, namespace) if hasattr(self.cache, "peek") else []
        matched = sum(n for _, n in path) * ps
        out: dict[str, Any] = {
            "namespace": namespace,
            "prompt_tokens": len(ids),
            "page_size": ps,
            "matched_tokens": matched,
            "cached_tokens": min(matched, limit),
            "computed_tokens": len(ids) - min(matched, limit),
            "path": [
                {"id": node.id, "key": format(node.keys[0], "016x"), "pages": len(node.pages), "pages_matched": n}
                for node, n in path
            ],
            "matched_text": self.decode(ids[:matched][-PREVIEW_TOKENS:]),
        }
        out.update(self._leave_reason(ids, path, matched, limit))
        return out

    def _leave_reason(self, ids: list[int], path: list[tuple[Any, int]], matched: int, limit: int) -> dict[str, Any]:
        ps = self.page_size
        rest = ids[matched:]
        info: dict[str, Any] = {"next_text": self.decode(rest[:PREVIEW_TOKENS])}
        if matched >= limit:
            info["reason"] = "hit" if matched else "short"
            info["explanation"] = (
                f"every full page the cache may serve is cached ({min(matched, limit)} tokens); the last "
                f"{len(ids) - limit} tokens are computed: only full pages of {ps} are cached, and the last token is "
                f"always computed to have logits to sample from"
            )
            return info
        node, n = path[-1] if path else (self.cache.root, 0)
        if path and n < len(node.pages):
            held = np.frombuffer(node.token_bytes, dtype="<i4")[n * ps : (n + 1) * ps].tolist()
            mine = ids[matched : matched + ps]
            diff = next((i for i, (a, b) in enumerate(zip(held, mine)) if a != b), 0)
            info.update(
                reason="diverged",
                node=node.id,
                at_token=matched + diff,
                tree_text=self.decode(held[diff:]),
                prompt_token=mine[diff],
                tree_token=held[diff],
            )
            info["explanation"] = (
                f"the prompt leaves the tree inside node {node.id} at token {matched + diff}: "
                f"the tree holds other tokens there"
            )
            return info
        if not path:
            info.update(
                reason="cold",
                node=None,
                at_token=0,
                explanation=(
                    "nothing of this prompt is cached in its namespace (not seen yet, evicted, or another namespace)"
                ),
            )
            return info
        info.update(
            reason="no_child",
            node=node.id,
            at_token=matched,
            num_children=len(node.children),
            explanation=(
                f"the prompt leaves the tree after token {matched}: node {node.id} has "
                f"{len(node.children)} children and none continues with the prompt's next page"
            ),
        )
        return info


def pool_view(engine: Any) -> dict[str, int]:
    """Pages of the KV pool by state, as /metrics counts them (scheduler/pages.py PoolStates): free, cached and
    evictable (kept partial pages included), cached and locked, held privately by running requests."""
    pages = engine.scheduler.pool_states()
    return {
        "total": pages.total,
        "free": pages.free,
        "cached_evictable": pages.evictable,
        "locked": pages.tree_locked,
        "partial_kept": pages.partial_kept,
        "in_flight": pages.private,
        "page_size": engine.runner.pool.page_size,
    }


def request_rows(engine: Any, scope: NamespaceScope) -> dict[str, list[dict[str, Any]]]:
    """Running and waiting requests the caller may see, with cached vs computed prompt tokens."""
    sched = engine.scheduler
    now = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {"running": [], "waiting": []}
    for state, reqs in (("running", list(sched.running)), ("waiting", list(sched.waiting))):
        for r in reqs:
            if not scope.allows(r.namespace):
                continue
            computed = max(min(r.kv_len, len(r.input_ids)) - r.cached_tokens, 0) if state == "running" else 0
            rows[state].append(
                {
                    "rid": r.rid,
                    "namespace": r.namespace,
                    "prompt_tokens": len(r.input_ids),
                    "cached_tokens": r.cached_tokens,
                    "computed_tokens": computed,
                    "output_tokens": len(r.output_ids),
                    "age_s": round(now - r.created, 3),
                }
            )
    return rows
