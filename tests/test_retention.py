"""Retention in the radix cache's eviction order (radixserve/cache/retention.py): priorities, expiry, refresh on hit,
budgets per tenant, and a retained prefix that outlives a flood until its time runs out."""

from __future__ import annotations

import pytest
import torch

from radix_helpers import put
from radixserve.cache.continuation_index import ContinuationIndex
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.retention import Retention
from radixserve.cache.tree_node import TreeNode
from radixserve.request import Req
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig

PS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_pages: int = 64, share: float = 1.0, per_tenant: float = 1.0) -> tuple[KVPool, RadixCache, Clock]:
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=PS, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool, PS, index=ContinuationIndex(), retained_share=share, retained_share_per_tenant=per_tenant)
    clock = Clock()
    cache.now = clock
    return pool, cache, clock


def seq(base: int, pages: int) -> list[int]:
    return list(range(base, base + pages * PS))


def node_of(cache: RadixCache, tokens: list[int]) -> TreeNode:
    path = cache.peek(tokens)
    assert path and sum(n for _, n in path) * PS == len(tokens), "the prefix is cached whole"
    return path[-1][0]


def cached(cache: RadixCache, tokens: list[int]) -> bool:
    return sum(n for _, n in cache.peek(tokens)) * PS == len(tokens)


def flood(pool: KVPool, cache: RadixCache, base: int, prompts: int, pages: int = 2) -> None:
    """One-shot prompts that overflow the pool: each takes free pages, evicting when short, as the scheduler does."""
    for i in range(prompts):
        tokens = seq(base + 1000 * i, pages)
        got = pool.alloc(pages)
        if got is None:
            cache.evict(pages - pool.num_free_pages)
            got = pool.alloc(pages)
        assert got is not None, "the flood's pages come from eviction"
        cache.insert(tokens, got)
        cache.check_invariants()


def evict_order(cache: RadixCache, prompts: dict[str, list[int]]) -> list[str]:
    """The prompts' names in the order one-page evictions take their last page."""
    order = []
    while any(cached(cache, t) for t in prompts.values()):
        cache.evict(1)
        order += [name for name, t in prompts.items() if name not in order and not cached(cache, t)]
        cache.check_invariants()
    return order


def test_eviction_order_mixed_priorities_and_expiries() -> None:
    pool, cache, clock = make()
    prompts = {name: seq(1000 * i, 1) for i, name in enumerate(["plain_old", "low", "high", "short", "plain_new"])}
    for t in prompts.values():
        put(pool, cache, t)
    cache.retain(node_of(cache, prompts["low"]), Retention(100, priority=10))
    cache.retain(node_of(cache, prompts["high"]), Retention(100, priority=90))
    cache.retain(node_of(cache, prompts["short"]), Retention(5, priority=90))
    assert cache.retained_pages == 3
    clock.t += 10  # "short" has run out: it decays to plain LRU, where its last access puts it after plain_old
    assert evict_order(cache, prompts) == ["plain_old", "short", "plain_new", "low", "high"]
    assert cache.retained_pages == 0 and cache.order.stats.expired_nodes == 1


def test_hit_refreshes_retention() -> None:
    pool, cache, clock = make()
    kept, other = seq(0, 2), seq(5000, 2)
    put(pool, cache, kept)
    put(pool, cache, other)
    cache.retain(node_of(cache, kept), Retention(10))
    clock.t += 8
    assert len(cache.match_prefix(kept + [1]).pages) == 2  # a hit at t+8: retained until t+18
    clock.t += 8  # t+16: past the first expiry, within the refreshed one
    cache.evict(2)
    assert cached(cache, kept) and not cached(cache, other)
    clock.t += 3  # t+19: the refreshed retention ran out too
    cache.evict(2)
    assert not cached(cache, kept)
    cache.check_invariants()


def test_expired_retention_is_not_refreshed_by_a_hit() -> None:
    pool, cache, clock = make()
    kept = seq(0, 1)
    put(pool, cache, kept)
    cache.retain(node_of(cache, kept), Retention(5))
    clock.t += 6
    cache.match_prefix(kept + [1])
    assert cache.retained_pages == 0, "a retention that ran out decays; a later hit is a plain LRU touch"
    cache.check_invariants()


def test_retained_prefix_survives_a_flood_then_goes_after_its_ttl() -> None:
    pool, cache, clock = make(num_pages=33, share=0.5)
    agent = seq(0, 8)
    put(pool, cache, agent)
    cache.retain(node_of(cache, agent), Retention(20))
    flood(pool, cache, 100_000, prompts=40)  # 80 pages through a 32-page pool
    assert cached(cache, agent), "the retained prefix outlives a flood that evicted everything else"
    assert not cached(cache, seq(100_000, 2)), "the flood's own early prompts were evicted"
    clock.t += 21
    flood(pool, cache, 200_000, prompts=20)
    assert not cached(cache, agent), "after its ttl it is evicted like any plain prefix"
    assert cache.retained_pages == 0


def test_without_retention_the_flood_evicts_the_prefix() -> None:
    pool, cache, _ = make(num_pages=33)
    agent = seq(0, 8)
    put(pool, cache, agent)
    flood(pool, cache, 100_000, prompts=40)
    assert not cached(cache, agent)


def test_budgets_per_tenant_and_pool() -> None:
    pool, cache, clock = make(num_pages=41, share=0.5, per_tenant=0.25)  # capacity 40: 20 retained, 10 per tenant
    a = [seq(1000 * i, 4) for i in range(4)]
    for t in a:
        put(pool, cache, t)
    assert cache.retain(node_of(cache, a[0]), Retention(60, tenant="a"))
    clock.t += 1
    assert cache.retain(node_of(cache, a[1]), Retention(60, tenant="a"))
    assert cache.retain(node_of(cache, a[3]), Retention(60, tenant="b"))
    clock.t += 1
    assert cache.retain(node_of(cache, a[2]), Retention(60, tenant="a")), "12 pages is over a's 10: room is made"
    assert node_of(cache, a[0]).priority == 0, "by decaying a's retention that expires soonest"
    assert node_of(cache, a[3]).priority and cache.order.by_tenant == {"a": 8, "b": 4}, "b's is never touched"
    assert cache.order.stats.displaced_nodes == 1 and cache.order.stats.refused == 0
    big = seq(90_000, 11)
    put(pool, cache, big)
    assert not cache.retain(node_of(cache, big), Retention(60, tenant="c")), "11 pages never fit a share of 10"
    assert cache.retain(node_of(cache, a[1]), Retention(60, tenant="b")), "already retained: nothing new to count"
    c = [seq(50_000 + 1000 * i, 6) for i in range(2)]
    for t in c:
        put(pool, cache, t)
    assert cache.retain(node_of(cache, c[0]), Retention(60, tenant="c"))
    assert not cache.retain(node_of(cache, c[1]), Retention(60, tenant="d")), "18 + 6 is over the pool's 20"
    assert cache.retained_pages == 18 and cache.order.stats.refused == 2
    cache.check_invariants()


def test_displacement_keeps_the_path_being_retained() -> None:
    pool, cache, clock = make(num_pages=21, per_tenant=0.3)  # capacity 20: 6 pages per tenant
    stem = seq(0, 4)
    put(pool, cache, stem + seq(500, 1))
    put(pool, cache, stem + seq(600, 2))
    assert cache.retain(node_of(cache, stem + seq(500, 1)), Retention(10, tenant="a"))  # stem 4 + 1
    clock.t += 1
    assert cache.retain(node_of(cache, stem + seq(600, 2)), Retention(10, tenant="a")), "the other branch goes"
    assert node_of(cache, stem).priority and cache.order.by_tenant == {"a": 6}
    cache.check_invariants()


def test_split_keeps_retention_on_both_parts() -> None:
    pool, cache, clock = make()
    kept = seq(0, 4)
    put(pool, cache, kept)
    cache.retain(node_of(cache, kept), Retention(30, priority=70, tenant="t"))
    m = cache.match_prefix(kept[: 2 * PS + 1])  # splits the node after two pages
    assert m.node.priority == 70 and m.node.retain_tenant == "t"
    cache.check_invariants()
    clock.t += 31
    cache.evict(1)
    assert cache.retained_pages == 0 and cache.order.retained_nodes == 0
    cache.check_invariants()


def test_retention_of_a_path_counts_its_ancestors() -> None:
    pool, cache, _ = make()
    stem = seq(0, 2)
    put(pool, cache, stem + seq(900, 2))
    put(pool, cache, stem + seq(700, 1))
    cache.retain(node_of(cache, stem + seq(700, 1)), Retention(30))
    assert cache.retained_pages == 3, "the leaf and the shared stem above it"
    cache.evict(2)
    assert cached(cache, stem + seq(700, 1)) and not cached(cache, stem + seq(900, 2))
    cache.check_invariants()


class RecordingTier:
    """What eviction spilled: (tokens of the node, first page spilled)."""

    def __init__(self) -> None:
        self.spilled: list[list[int]] = []

    def spill(self, cache: RadixCache, node: TreeNode, first: int) -> None:
        self.spilled.append(node.tokens[first * PS :])


def test_expired_retained_prefix_is_written_down_before_it_is_dropped() -> None:
    pool, cache, clock = make(num_pages=17)
    tier = RecordingTier()
    cache.tier = tier  # type: ignore[assignment]
    agent = seq(0, 4)
    put(pool, cache, agent)
    cache.retain(node_of(cache, agent), Retention(10))
    clock.t += 11
    flood(pool, cache, 100_000, prompts=10)
    assert not cached(cache, agent)
    spilled = {t for run in tier.spilled for t in run}
    assert set(agent) <= spilled, "its pages went to the tier on their way out of the pool"


def test_retention_rejects_bad_values() -> None:
    for bad in ({"seconds": 0}, {"seconds": 1e9}, {"seconds": 5, "priority": 0}, {"seconds": 5, "priority": 101}):
        with pytest.raises(ValueError):
            Retention(**bad)  # type: ignore[arg-type]


def test_reset_and_flush_drop_retention() -> None:
    pool, cache, _ = make()
    a, b = seq(0, 2), seq(5000, 2)
    put(pool, cache, a)
    put(pool, cache, b, namespace="x")
    cache.retain(node_of(cache, a), Retention(30))
    cache.retain(cache.peek(b, "x")[-1][0], Retention(30, tenant="x"))
    cache.flush_namespaces(lambda ns: ns == "x")
    assert cache.order.by_tenant == {"": 2}
    cache.check_invariants()
    cache.reset()
    assert cache.retained_pages == 0
    cache.check_invariants()


def test_a_turn_that_arrives_in_time_keeps_its_prefix_while_it_waits() -> None:
    """The retention runs from the request's arrival: steps that admit nobody (their prefill budget taken by
    running chunks) match nobody, so a turn queued past its prefix's expiry would find it evicted."""
    params = SamplingParams(max_new_tokens=1)
    sched = Scheduler(SchedulerConfig(page_size=PS, context_length=1024), make()[0], frozenset())
    cache, clock = sched.cache, Clock()
    assert isinstance(cache, RadixCache)
    cache.now = clock
    history = seq(0, 4)
    put(sched.pool, cache, history)
    assert cache.retain(node_of(cache, history), Retention(10.0))
    clock.t += 9.0  # the next turn comes back 1 s before the retention would run out, and waits in the queue
    ids = history + [7, 7, 7]
    sched.add(Req("turn", ids, params, SamplingInfo(params, None, [], ids)))
    clock.t += 5.0
    flood(sched.pool, cache, 10_000, 40)
    assert cached(cache, history), "evicted while its turn waited, though the turn arrived within the retention"
