"""Explorer pieces without the shared server: request timelines and spans under retraction, and the tree
snapshot's bounded work (RadixCache.peek changes nothing)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.retention import Retention
from radixserve.server.cache_view import TreeReader
from radixserve.server.scope import NamespaceScope
from radixserve.server.tracing import RequestTracer

PAGE = 4


def walk(node: dict) -> Iterator[dict]:
    """Every node of a snapshot's JSON tree, depth first."""
    yield node
    for c in node["children"]:
        yield from walk(c)


def test_timelines_show_retractions_and_their_spans(tiny_model_dir: Path, make_engine) -> None:
    """Memory pressure (as in test_engine): requests are retracted and resumed; their timelines and spans say so."""
    rng = random.Random(3)
    eng = make_engine(
        tiny_model_dir,
        page_size=16,
        max_total_tokens=320,
        init_new_token_ratio=0.05,
        chunked_prefill_size=32,
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(eng.tracker, provider)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(6)]
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 60, "temperature": 0, "ignore_eos": True})
    tracer.flush()
    tracer.close()
    tls = list(eng.tracker.recent)
    assert len(tls) == 6 and sum(t.retractions for t in tls) == eng.metrics()["num_retractions"] > 0
    hit = next(t for t in tls if t.retractions)
    kinds = [s.kind for s in hit.spans]
    i = kinds.index("retracted")
    assert "prefill" in kinds[i:], "a retracted request prefills again (mostly from the cache) when it resumes"
    assert all(s.end is not None and s.end >= s.start for s in hit.spans)
    roots = {s.attributes["radixserve.rid"]: s for s in exporter.get_finished_spans() if s.name == "radixserve.request"}
    root = roots[hit.rid]
    assert root.attributes["radixserve.retractions"] == hit.retractions
    assert [e.name for e in root.events].count("retraction") == hit.retractions
    requeued = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "radixserve.requeued" and s.parent.span_id == root.context.span_id
    ]
    assert len(requeued) == hit.retractions


def test_snapshot_work_is_bounded_and_peek_changes_nothing() -> None:
    """On a 2,000-node tree: a snapshot shows at most max_nodes nodes, the most recently used first, one tenant's
    only; RadixCache.peek walks like match_prefix but touches, splits and locks nothing."""
    rng = random.Random(0)
    cache = RadixCache(KVPool(1, 12_000, PAGE, 1, 1, torch.float32), PAGE)
    prefixes = [[rng.randrange(3, 500) for _ in range(4 * PAGE)] for _ in range(20)]
    seqs = []
    for i in range(2000):
        toks = prefixes[i % 20] + [rng.randrange(3, 500) for _ in range(2 * PAGE)]
        cache.insert(toks, cache.pool.alloc(6), "t1" if i % 20 < 10 else "t2")
        seqs.append(toks)
    reader = TreeReader(cache, PAGE, lambda ids: " ".join(map(str, ids)), lambda clock: None)
    snap = reader.snapshot(NamespaceScope(None), max_nodes=50)
    assert snap.total_nodes == 2020 and snap.shown_nodes == 50 and snap.truncated
    assert len(list(walk(snap.to_dict()["root"]))) == 51
    newest = max((n for n in cache._nodes() if n.parent is cache.root), key=lambda n: n.last_access)
    assert snap.root.children[0].id == newest.id, "the most recently used subtree comes first"
    mine = reader.snapshot(NamespaceScope("t1"), max_nodes=5000)
    assert mine.shown_nodes == 1010 and {n["namespace"] for n in list(walk(mine.to_dict()["root"]))[1:]} == {"t1"}

    before = [(n.id, n.last_access, len(n.pages), n.lock_ref) for n in cache._nodes()]
    clock = cache._clock
    probe = seqs[7][: 5 * PAGE] + [1] * PAGE  # the prefix, one page of its branch, then a page the tree lacks
    path = cache.peek(probe, "t1")
    assert [n for _, n in path] == [4, 1], "the whole prefix node, then one page into a branch"
    assert cache._clock == clock and [(n.id, n.last_access, len(n.pages), n.lock_ref) for n in cache._nodes()] == before
    assert cache.peek(probe, "t2") == [], "namespaces never share a path"
    assert cache.match_prefix(probe + [1], "t1").num_tokens == 5 * PAGE
    cache.check_invariants()


def test_snapshot_shows_retention_left_and_priority() -> None:
    """A retained node carries its seconds left and priority (the explorer's retained colour); a plain one none, and
    one whose retention ran out shows none before the cache has decayed it."""
    pool = KVPool(num_layers=1, num_pages=16, page_size=PAGE, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool, PAGE)
    now = [100.0]
    cache.now = lambda: now[0]
    kept, plain = cache.insert(list(range(8)), pool.alloc(2)), cache.insert(list(range(50, 58)), pool.alloc(2))
    assert cache.retain(kept.node, Retention(30, priority=70))
    reader = TreeReader(cache, PAGE, lambda ids: " ".join(map(str, ids)), lambda clock: None)

    def views() -> dict[int, dict]:
        return {n["id"]: n for n in walk(reader.snapshot(NamespaceScope(None), max_nodes=50).to_dict()["root"])}

    shown = views()
    assert shown[kept.node.id]["retained_s"] == 30.0 and shown[kept.node.id]["retention_priority"] == 70
    assert shown[plain.node.id]["retained_s"] is None
    now[0] += 31
    assert views()[kept.node.id]["retained_s"] is None and cache.retained_pages == 2, "not decayed yet, shown as none"
