"""Routing policies: which healthy worker gets a request. Each returns the worker and why (for metrics and tests).

cache_aware follows SGLang's model gateway (sgl-model-gateway, formerly sgl-router):
- load is the number of requests the router has in flight on a worker;
- the pool is imbalanced when max_load - min_load > balance_abs_threshold AND max_load > balance_rel_threshold *
  min_load; SGLang then sends every request to the least loaded worker. Here only a worker that is itself that far
  above the least loaded one ("overloaded") loses its requests, so with three or more workers a conversation on a
  middle worker stays put; with two workers the two rules agree;
- otherwise the prompt text is matched against the approximate tree: if the longest match covers more than
  cache_threshold of the text, the worker with that match gets it (a conversation's next turn extends its last
  prompt, so it lands where its KV is); else the worker with the smallest tree (the most room for a new prefix);
- the text is then inserted into the chosen worker's branch of the tree.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.workers import Worker

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass
class CacheAwareConfig:
    # SGLang gateway defaults (its CLI: --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 2**24  # per worker; evicted down to this every eviction_interval_s
    eviction_interval_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.max_tree_chars < 1 or self.eviction_interval_s <= 0:
            raise ValueError("max_tree_chars and eviction_interval_s must be positive")


class Policy:
    name = ""

    def choose(self, key: str, workers: list[Worker], start: int = 0) -> tuple[Worker, str]:
        """key[:start] is the namespace, which must match but does not count toward the match rate."""
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """A worker left or lost its cache."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.counter = itertools.count()

    def choose(self, key: str, workers: list[Worker], start: int = 0) -> tuple[Worker, str]:
        return workers[next(self.counter) % len(workers)], "round_robin"


def least_loaded(workers: list[Worker]) -> Worker:
    return min(workers, key=lambda w: w.load)  # ties: the first listed, i.e. the earliest added


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, key: str, workers: list[Worker], start: int = 0) -> tuple[Worker, str]:
        return least_loaded(workers), "least_load"


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None, tree: PrefixTree | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = tree or PrefixTree()
        self.lock = threading.Lock()  # the health thread evicts and forgets while the serving loop routes

    def overloaded(self, worker: Worker, min_load: int) -> bool:
        c = self.config
        return worker.load - min_load > c.balance_abs_threshold and worker.load > c.balance_rel_threshold * min_load

    def choose(self, key: str, workers: list[Worker], start: int = 0) -> tuple[Worker, str]:
        with self.lock:
            return self._choose(key, workers, start)

    def _choose(self, key: str, workers: list[Worker], start: int) -> tuple[Worker, str]:
        min_load = min(w.load for w in workers)
        by_url = {w.url: w for w in workers}
        matched = {u: n for u, n in self.tree.match(key).items() if u in by_url}
        best = max(matched, key=lambda u: (matched[u], -by_url[u].load), default=None)
        rate = (matched[best] - start) / (len(key) - start) if best is not None and len(key) > start else 0.0
        if rate > self.config.cache_threshold:
            chosen, why = by_url[best], "cache_hit"
            if self.overloaded(chosen, min_load):
                chosen, why = least_loaded(workers), "imbalanced"
        else:
            candidates = [w for w in workers if not self.overloaded(w, min_load)]
            chosen = min(candidates, key=lambda w: (self.tree.size(w.url), w.load))
            why = "smallest_tree"
        self.tree.insert(key, chosen.url)
        return chosen, why

    def forget(self, url: str) -> None:
        with self.lock:
            self.tree.remove_worker(url)

    def evict(self) -> int:
        with self.lock:
            return self.tree.evict(self.config.max_tree_chars)


def make_policy(name: str, config: CacheAwareConfig | None = None) -> Policy:
    if name == "cache_aware":
        return CacheAware(config)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
