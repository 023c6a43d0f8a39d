"""The engine's prefix-cache surface: statistics per tier, pinning, and the tiers' life (open the host and disk
tiers, restore saved pins, checkpoint, persist at shutdown). A mixin of Engine, which provides `scheduler`,
`runner`, `inputs`, `loop` and `generate`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.kv_tier import KVTier, open_tier
from radixserve.cache.pins import PinError
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.retention import DEFAULT_PRIORITY
from radixserve.engine_config import EngineConfig
from radixserve.errors import ParamError
from radixserve.inputs import check_retention
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.scheduler import Scheduler
from radixserve.tp_pool import ShardedPool

log = logging.getLogger(__name__)

RETENTION_KEYS = (
    "retained_pages",
    "retained_bytes",
    "retained_nodes",
    "retained_tenants",
    "retentions",
    "retentions_refused",
    "retention_expired_nodes",
    "retention_displaced_nodes",
)

CHECKPOINT_S = 30.0  # an idle engine writes pages the disk tier lacks and its index at most this often
TIER_KEYS = (
    "disk_pages",
    "disk_bytes",
    "disk_limit_bytes",
    "disk_hit_tokens",
    "spilled_pages",
    "loaded_pages",
    "load_seconds",
    "load_seconds_per_page",
    "disk_bad_files",
    "disk_lru_evicted_pages",
    "disk_write_errors",
    "host_pages",
    "host_bytes",
    "host_limit_bytes",
    "host_lru_evicted_pages",
    "host_hit_tokens",
    "host_spilled_pages",
    "host_loaded_pages",
    "host_load_seconds",
    "host_load_seconds_per_page",
)


def attach_tier(
    config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, model_path: Any, quantization: str
) -> KVTier | None:
    """Open the host tier and --kv-cache-dir under the scheduler's radix cache (None when both are off or unusable)
    and pin again what the last run on the directory had pinned (before the loop starts: nothing else runs)."""
    cache = scheduler.cache
    if not isinstance(cache, RadixCache):
        return None
    pool = scheduler.pool
    if runner.tp is not None:  # the tiers store whole pages: every rank gives and takes its heads' shard
        pool = cast(KVPool, ShardedPool(pool, runner.tp, runner.config))  # the pool's interface, pages whole
    cfg = runner.config  # the whole model's: the pages the tiers store hold every KV head
    tier = open_tier(
        config.kv_cache_dir,
        config.kv_cache_disk_gb,
        config.kv_cache_host_gb,
        model_path,
        quantization,
        pool,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    cache.tier = tier
    if tier is None or tier.store is None:
        return tier
    scheduler.pins.restore(cache, tier.store.load_pins(), tier.load_prefix)
    scheduler.pins.on_change = tier.store.save_pins
    tier.store.save_pins(scheduler.pins.entries())
    return tier


class Checkpointer:
    """Called by the engine loop when idle: persists the tree to the disk tier every CHECKPOINT_S seconds."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.last = time.monotonic()

    def __call__(self) -> None:
        tier = self.scheduler.cache.tier
        if tier is None or time.monotonic() - self.last < CHECKPOINT_S:
            return
        self.last = time.monotonic()
        tier.persist(self.scheduler.cache)  # type: ignore[arg-type]


def close_tier(scheduler: Scheduler) -> None:
    """Persist the tree and release the directory (after the loop has stopped: nothing else touches the cache)."""
    tier = scheduler.cache.tier
    if tier is not None:
        tier.close(scheduler.cache)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TenantRetention:
    """Retained pages per retention tenant (an API key's namespace, else a request's cache_salt), for /metrics."""

    pages: dict[str, int]
    page_bytes: int
    max_pages_per_tenant: int  # --max-retained-share-per-tenant of the pool


def retention_stats(cache: RadixCache | Any, page_bytes: int) -> dict[str, int]:
    """Retained pages and bytes now (radixserve/cache/retention.py), and the retentions made, refused and expired."""
    if not isinstance(cache, RadixCache):
        return dict.fromkeys(RETENTION_KEYS, 0)
    order = cache.order
    return {
        "retained_pages": order.retained_pages,
        "retained_bytes": order.retained_pages * page_bytes,
        "retained_nodes": order.retained_nodes,
        "retained_tenants": len(order.by_tenant),
        "retentions": order.stats.retained,
        "retentions_refused": order.stats.refused,
        "retention_expired_nodes": order.stats.expired_nodes,
        "retention_displaced_nodes": order.stats.displaced_nodes,
    }


class CacheSurface:
    scheduler: Scheduler
    runner: Any
    inputs: Any
    loop: Any

    def tier_stats(self) -> dict[str, Any]:
        """Per-tier pages, bytes and hits (device = the KV pool; host = the host-RAM tier; disk = --kv-cache-dir);
        zeros for a tier that is off."""
        s, cache = self.scheduler.stats, self.scheduler.cache
        page_bytes = self._page_bytes()
        tier = cache.tier.snapshot() if cache.tier is not None else dict.fromkeys(TIER_KEYS, 0)
        pinned = len(self.scheduler.pins.pinned_pages(cache)) if isinstance(cache, RadixCache) else 0
        return {
            **retention_stats(cache, page_bytes),
            "device_pages": cache.total_pages,
            "device_bytes": cache.total_pages * page_bytes,
            "device_hit_tokens": max(s.hit_tokens - tier["disk_hit_tokens"] - tier["host_hit_tokens"], 0),
            "pinned_pages": pinned,
            "kv_cache_dir_enabled": cache.tier is not None and cache.tier.store is not None,
            "host_tier_enabled": cache.tier is not None and cache.tier.host is not None,
            **tier,
        }

    def _page_bytes(self) -> int:
        """Whole pages (every KV head, as the tiers store them) in the pool's format: int8 counts its scales."""
        pool, cfg = self.runner.pool, self.runner.config
        return pool.format.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * pool.page_size

    def retained_by_tenant(self) -> TenantRetention:
        """Retained pages per tenant now (read on the engine's loop, so the counts are one step's)."""

        def read() -> TenantRetention:
            cache = self.scheduler.cache
            if not isinstance(cache, RadixCache):
                return TenantRetention({}, self._page_bytes(), 0)
            return TenantRetention(dict(cache.order.by_tenant), self._page_bytes(), cache.order.max_pages_per_tenant)

        return self.loop.call(read)

    def pin(self, prompt: str | None = None, input_ids: list[int] | None = None, cache_salt: str = "") -> dict:
        """Compute (or find) the prompt's KV and keep its full pages out of eviction; ParamError if it cannot."""
        if not isinstance(self.scheduler.cache, RadixCache):
            raise ParamError("prompt", "pinning needs the radix cache (it is disabled)")
        ids = self._pin_ids(prompt, input_ids, cache_salt)
        self.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, cache_salt=cache_salt)  # type: ignore

        def do() -> int:
            try:
                return self.scheduler.pins.pin(self.scheduler.cache, ids, cache_salt)  # type: ignore[arg-type]
            except PinError as exc:
                raise ParamError("prompt", str(exc)) from None

        pages = self.loop.call(do)
        return {"pinned_tokens": pages * self.runner.pool.page_size, "prompt_tokens": len(ids)}

    def unpin(self, prompt: str | None = None, input_ids: list[int] | None = None, cache_salt: str = "") -> bool:
        """Release a pin made with the same prompt and salt; False if there was none."""
        if not isinstance(self.scheduler.cache, RadixCache):
            return False
        ids = self._pin_ids(prompt, input_ids, cache_salt)
        return self.loop.call(lambda: self.scheduler.pins.unpin(self.scheduler.cache, ids, cache_salt))

    def retain(
        self,
        input_ids: list[int],
        retention_seconds: float,
        retention_priority: int = DEFAULT_PRIORITY,
        cache_salt: str = "",
        tenant: str | None = None,
        wait: bool = True,
    ) -> bool | None:
        """Retain the cached full pages of `input_ids` (e.g. a finished request's prompt + output ids) as a request's
        `retention_seconds` would; True if retained, False if not cached or over the retention budget. wait=False
        queues it for the loop and returns None at once (the server's agent retention, which must not hold a
        response up for a step)."""
        r = check_retention(retention_seconds, retention_priority, cache_salt if tenant is None else tenant)
        assert r is not None
        ids = list(input_ids)

        def do() -> bool:
            cache = self.scheduler.cache
            n = len(ids) // cache.page_size * cache.page_size if isinstance(cache, RadixCache) else 0
            if n == 0:
                return False
            m = cache.match_prefix(ids[:n] + [0], cache_salt)  # +1 token: every full page may match
            return bool(m.pages) and cache.retain(m.node, r)

        if wait:
            return bool(self.loop.call(do))
        self.loop.post(do)
        return None

    def _pin_ids(self, prompt: str | None, input_ids: list[int] | None, cache_salt: str) -> list[int]:
        """The prompt's tokens exactly as a generate call with it would see them."""
        specs, single = self.inputs.specs(prompt, {"max_new_tokens": 0}, input_ids, False, -1, 0, cache_salt, None)
        if not single or len(specs) != 1:
            raise ParamError("prompt", "pin takes a single prompt")
        return specs[0].input_ids
