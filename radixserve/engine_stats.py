"""What an Engine tells about itself: cache and scheduler counters (`cache_stats`, `metrics`), the model and the
choices made for it (`model_info`), and the maintenance calls that go through its loop (`flush_cache`,
`check_invariants`). A mixin of `Engine`; every read runs on the engine loop, between steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.speculative.drafter import spec_stats

_TIER_COUNTERS = (
    "device_hit_tokens",
    "disk_hit_tokens",
    "spilled_pages",
    "loaded_pages",
    "load_seconds",
    "host_hit_tokens",
    "host_spilled_pages",
    "host_loaded_pages",
    "host_load_seconds",
    "retentions",
    "retentions_refused",
    "retention_expired_nodes",
    "retention_displaced_nodes",
)


class EngineStats:
    scheduler: Any
    runner: Any
    loop: Any
    config: Any

    # ---- introspection ------------------------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, Any]:
        return self.loop.call(self._cache_stats)

    def _cache_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        pages = self.scheduler.pool_states()
        return {
            "hit_tokens": s.hit_tokens,
            "partial_page_hit_tokens": s.partial_page_hit_tokens,
            "prompt_tokens": s.prompt_tokens,
            "hit_rate": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "total_pages": pages.total,
            "free_pages": pages.free,
            "cached_pages": pages.cached,
            "evictable_pages": pages.evictable,
            "locked_pages": pages.tree_locked,
            "partial_pages": pages.partial_kept,
            "private_pages": pages.private,
            "page_size": self.runner.pool.page_size,
            "dtype": self.dtype_name,
            "quantization": self.quantization,
            "quantization_reason": self.cpu_choice.reason,
            **spec_stats(self.scheduler.drafter),
            **self.tier_stats(),
        }

    def metrics(self) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            s = self.scheduler.stats
            cache = self._cache_stats()  # (its tier_stats give the tier counters below)
            return {
                **cache,
                "num_running": len(self.scheduler.running) + len(self.scheduler.finishing),
                "num_waiting": len(self.scheduler.waiting),
                "num_retractions": s.retractions,
                "prompt_tokens_total": s.prompt_tokens,
                "generation_tokens_total": s.generation_tokens,
                "cached_tokens_total": s.hit_tokens,
                "partial_page_hit_tokens_total": s.partial_page_hit_tokens,
                "computed_prefill_tokens_total": s.computed_prefill_tokens,
                "failed_requests_total": s.failed,
                "failed_steps_total": s.failed_steps,
                **{f"{k}_total": v for k, v in cache.items() if k in _TIER_COUNTERS},
            }

        return self.loop.call(snapshot)

    def flush_cache(self, namespace: Callable[[str], bool] | None = None) -> bool | int:
        """namespace None: drop every cached page (False while requests run, nothing dropped then). With a predicate
        on namespaces: drop the unlocked pool pages and every host and disk page of the namespaces it accepts,
        whatever runs; returns how many (a page held in two tiers counts twice)."""
        if namespace is None:
            return self.loop.call(self.scheduler.flush_cache)
        return self.loop.call(lambda: self.scheduler.flush_namespaces(namespace))

    def check_invariants(self) -> None:
        self.loop.call(self.scheduler.check_invariants)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": str(self.model_path),
            "model_name": Path(self.model_path).name,
            "context_length": self.context_length,
            "page_size": self.runner.pool.page_size,
            "vocab_size": self.runner.config.vocab_size,
            "dtype": self.dtype_name,
            "quantization": self.quantization,
            "quantization_reason": self.cpu_choice.reason,
            "kv_cache_dtype": self.runner.pool.format.name,  # auto resolved: how the KV pages are stored
            "attention_backend": self.attention_backend,
            "tp": self.config.tp,
            "sampling_defaults": dict(self.sampling_defaults),
            "speculative": self.speculative.reason,
            "deterministic": self.deterministic,
        }
