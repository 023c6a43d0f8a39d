"""An approximate, character-level radix tree shared by all workers: which worker has probably cached which prompt.

The router never sees a worker's real cache; it remembers the routing keys (prompt text) it sent to each worker and
assumes the worker still holds their KV. One tree holds every worker: each node lists the workers that were sent its
text, with the time they last were. The invariant "a worker on a node is on all its ancestors" holds because insert
marks whole paths and eviction only ever removes a worker from a node none of whose children it is on.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable


class Node:
    __slots__ = ("text", "children", "workers", "parent")

    def __init__(self, text: str, parent: Node | None) -> None:
        self.text = text  # the edge label from the parent
        self.children: dict[str, Node] = {}  # first character -> child
        self.workers: dict[str, float] = {}  # worker url -> last access time
        self.parent = parent


def _common_len(a: str, b: str, start: int) -> int:
    """Length of the common prefix of a and b[start:] (a is an edge label, usually short)."""
    if b.startswith(a, start):
        return len(a)
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixTree:
    """insert(text, worker) after routing; match(text) -> {worker: matched characters}; evict to a size per worker."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Node("", None)
        self.clock = clock
        self.sizes: dict[str, int] = {}  # worker -> characters of tree text it is on

    def size(self, worker: str) -> int:
        return self.sizes.get(worker, 0)

    def insert(self, text: str, worker: str) -> None:
        now = self.clock()
        node = self.root
        node.workers[worker] = now
        self.sizes.setdefault(worker, 0)
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = Node(text[pos:], node)
                node.children[text[pos]] = child
            else:
                k = _common_len(child.text, text, pos)
                if k < len(child.text):
                    child = self._split(child, k)
            if worker not in child.workers:
                self.sizes[worker] += len(child.text)
            child.workers[worker] = now
            pos += len(child.text)
            node = child

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k characters; returns the new upper node (it keeps the child's workers)."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.text[:k], parent)
        upper.workers = dict(child.workers)  # sizes are unchanged: the same characters, now on two nodes
        parent.children[child.text[0]] = upper
        child.text = child.text[k:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def match(self, text: str) -> dict[str, int]:
        """For each worker, how many leading characters of text it was sent (0 for none). Only insert refreshes the
        access time: the worker the router then picks, not every worker that happened to match."""
        best: dict[str, int] = dict.fromkeys(self.root.workers, 0)
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common_len(child.text, text, pos)
            for w in child.workers:  # deeper nodes only hold workers their ancestors hold: this is each one's depth
                best[w] = pos + k
            if k < len(child.text):
                break
            pos += k
            node = child
        return best

    def remove_worker(self, worker: str) -> None:
        """Forget everything sent to worker (it left, or came back with an empty cache)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.workers.pop(worker, None) is None:
                continue  # the invariant: none of its descendants hold worker either
            stack.extend(node.children.values())
            if not node.workers and node is not self.root:
                self._unlink(node)
        self.sizes.pop(worker, None)

    def _unlink(self, node: Node) -> None:
        if node.parent is not None and node.parent.children.get(node.text[0]) is node:
            del node.parent.children[node.text[0]]

    def evict(self, max_chars: int) -> int:
        """Drop each worker's least recently used leaves until it is on at most max_chars characters (as SGLang's
        gateway does periodically, since a worker's real cache forgets old prefixes too). Returns characters dropped."""
        over = {w for w, s in self.sizes.items() if s > max_chars}
        if not over:
            return 0
        heaps: dict[str, list[tuple[float, int, Node]]] = {w: [] for w in over}
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for w in over.intersection(node.workers):
                if node is not self.root and not any(w in c.workers for c in node.children.values()):
                    heaps[w].append((node.workers[w], id(node), node))
        dropped = 0
        for w, heap in heaps.items():
            heapq.heapify(heap)
            while self.sizes[w] > max_chars and heap:
                _, _, node = heapq.heappop(heap)
                del node.workers[w]
                self.sizes[w] -= len(node.text)
                dropped += len(node.text)
                parent = node.parent
                if not node.workers:
                    self._unlink(node)
                if (
                    parent is not None
                    and parent is not self.root
                    and w in parent.workers
                    and not any(w in c.workers for c in parent.children.values())
                ):
                    heapq.heappush(heap, (parent.workers[w], id(parent), parent))
        return dropped
