"""Retention per tenant in /metrics: each API key's retained pages and bytes, beside the pool-wide figures.

A key's requests retain under its tenant, the key's cache namespace (serving.scheduling_args), and each tenant may
hold at most --max-retained-share-per-tenant of the pool: these gauges show how close each key is to that bound, by
key name (never the key, nor the namespace digest). Only with API keys: without them a request's tenant is its
cache_salt, which a client chooses freely, so labels by it would grow without bound (the pool-wide
`radixserve_retained_tenants` counts them instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.server.quotas import PREFIX
from radixserve.server.tenants import KeyRing


class KeyRetentionCollector(Collector):
    """Reads the engine's retained pages per tenant once per scrape; `only` restricts them to one key name (what a
    user key may read of itself)."""

    def __init__(self, engine: Any, keys: KeyRing, only: str | None = None) -> None:
        self.engine = engine
        self.keys = keys
        self.only = only

    def collect(self) -> Iterator[Metric]:
        held = self.engine.retained_by_tenant()
        names = sorted(
            {(p.name, p.namespace) for p in self.keys.principals if self.only is None or p.name == self.only}
        )
        pages = GaugeMetricFamily(
            PREFIX + "retained_pages", "radix tree pages retained by the key, by key name", labels=["key"]
        )
        size = GaugeMetricFamily(
            PREFIX + "retained_bytes", "KV bytes of the key's retained pages, by key name", labels=["key"]
        )
        limit = GaugeMetricFamily(
            PREFIX + "retained_pages_limit",
            "pages one key may retain (--max-retained-share-per-tenant of the pool), by key name",
            labels=["key"],
        )
        for name, namespace in names:
            n = held.pages.get(namespace, 0)
            pages.add_metric([name], n)
            size.add_metric([name], n * held.page_bytes)
            limit.add_metric([name], held.max_pages_per_tenant)
        yield pages
        yield size
        yield limit
