"""Every setting of an Engine in one validated dataclass: `Engine(EngineConfig(...))` or `Engine(**fields)`; the
CLI's engine flags are checked against these fields (tests/test_cli.py) and the scheduler's and runner's settings
are derived from it. A bad value raises ParamError naming the field, at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from radixserve.cache.kv_format import KV_DTYPES
from radixserve.errors import ParamError
from radixserve.model.cpu_select import QUANTIZATIONS
from radixserve.speculative.mode import MODES as SPECULATIVE_MODES

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path | None = None  # HF folder or .gguf; None: the default model
    dtype: str = "auto"  # auto: bfloat16
    device: str = "cpu"
    page_size: int = 16
    max_total_tokens: int | None = None  # KV pool tokens; None: from free memory (CPU: at most 64k)
    kv_cache_gb: float | None = None  # KV pool as a memory budget in GiB instead (tokens follow from kv_cache_dtype)
    kv_cache_dtype: str = "auto"  # how KV pages are stored (radixserve/cache/kv_format.py); auto: the model's dtype
    context_length: int | None = None  # None: the model's own
    attention_backend: str | None = None  # None: flashinfer on CUDA (triton for float32), torch elsewhere
    enable_radix_cache: bool = True
    enable_partial_page_reuse: bool = True  # copy the matched rows of a cached partial page (page_size > 1)
    schedule_policy: str = "lpm"
    fair_share: bool = True  # admission shares prefill tokens fairly between tenants (radixserve/scheduler/fairness.py)
    chunked_prefill_size: int = 512
    max_running_requests: int = 64
    max_queued_requests: int | None = None  # None: no limit
    init_new_token_ratio: float = 0.7
    overlap_schedule: bool | None = None  # None: on for CUDA, off on CPU
    prefill_merge_tokens: int | str | None = "auto"  # "auto": 32 on CPU, no limit on CUDA; None: no limit
    sampling_defaults: str = "model"  # "model": the publisher's values for what a request leaves unset; "none"
    quantization: str = (
        "auto"  # CPU weight format: auto (chosen by the CPU), none, int8, int4 (radixserve/model/quant.py), gguf
    )
    speculative: str = "auto"  # n-gram speculative decoding: auto (on for CPU), off, ngram (radixserve/speculative/)
    speculative_max_tokens: int = 8  # most drafted tokens verified per request and step
    kv_cache_dir: str | Path | None = None  # disk tier for evicted and persisted KV pages; None: off
    kv_cache_disk_gb: float = 10.0  # the disk tier's size limit (LRU past it)
    # the pinned host-RAM tier between the pool and the disk (radixserve/cache/host_tier.py), in GB; None: automatic
    # (on for CUDA, at most twice the pool and a quarter of the available RAM; off on CPU); 0: off
    kv_cache_host_gb: float | None = None
    max_pinned_share: float = 0.5  # pinned prefixes (/cache/pin) hold at most this share of the KV pool
    # retained prefixes (radixserve/cache/retention.py) hold at most this share of the pool, and each tenant this one
    max_retained_share: float = 0.5
    max_retained_share_per_tenant: float = 0.25
    enable_jump_forward: bool = True  # constrained decoding appends the tokens a grammar forces without sampling
    tp: int = 1  # tensor parallel ranks: tp - 1 workers share each layer (radixserve/distributed.py)
    null_model: bool = False  # benchmarks and tests: no weights, fixed logits at once (radixserve/model/null.py)
    # a request's tokens and logprobs independent of the cache, the batch, chunking and speculation
    # (radixserve/model/deterministic.py); None: on where it can run and costs nothing (the default CPU setting on
    # AVX-512 BF16 without AMX), else off
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        for name, ok, why in self._checks():
            if not ok:
                raise ParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        merge = self.prefill_merge_tokens
        return [
            ("dtype", self.dtype in ("auto", *DTYPES), f"must be one of auto, {', '.join(DTYPES)}"),
            ("page_size", _int(self.page_size) and self.page_size >= 1, "must be an integer >= 1"),
            (
                "max_total_tokens",
                self.max_total_tokens is None or (_int(self.max_total_tokens) and self.max_total_tokens >= 1),
                "must be an integer >= 1 or None",
            ),
            (
                "kv_cache_gb",
                self.kv_cache_gb is None or (_number(self.kv_cache_gb) and self.kv_cache_gb > 0),
                "must be > 0 or None",
            ),
            (
                "kv_cache_gb",
                self.kv_cache_gb is None or self.max_total_tokens is None,
                "and max_total_tokens both size the KV pool: set one",
            ),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_DTYPES, f"must be one of {', '.join(KV_DTYPES)}"),
            (
                "context_length",
                self.context_length is None or (_int(self.context_length) and self.context_length >= 2),
                "must be an integer >= 2 or None",
            ),
            (
                "attention_backend",
                self.attention_backend in (None, *ATTENTION_BACKENDS),
                f"must be one of {', '.join(ATTENTION_BACKENDS)} or None",
            ),
            ("enable_partial_page_reuse", isinstance(self.enable_partial_page_reuse, bool), "must be True or False"),
            ("schedule_policy", self.schedule_policy in ("lpm", "fcfs"), "must be 'lpm' or 'fcfs'"),
            ("fair_share", isinstance(self.fair_share, bool), "must be True or False"),
            (
                "chunked_prefill_size",
                _int(self.chunked_prefill_size) and self.chunked_prefill_size >= 1,
                "must be an integer >= 1",
            ),
            (
                "max_running_requests",
                _int(self.max_running_requests) and self.max_running_requests >= 1,
                "must be an integer >= 1",
            ),
            (
                "max_queued_requests",
                self.max_queued_requests is None or (_int(self.max_queued_requests) and self.max_queued_requests >= 0),
                "must be an integer >= 0 or None",
            ),
            (
                "init_new_token_ratio",
                isinstance(self.init_new_token_ratio, (int, float)) and 0 <= self.init_new_token_ratio <= 1,
                "must be in [0, 1]",
            ),
            (
                "prefill_merge_tokens",
                merge in ("auto", None) or (_int(merge) and merge >= 1),
                "must be an integer >= 1, None or 'auto'",
            ),
            ("sampling_defaults", self.sampling_defaults in ("model", "none"), "must be 'model' or 'none'"),
            ("enable_jump_forward", isinstance(self.enable_jump_forward, bool), "must be a bool"),
            ("quantization", self.quantization in QUANTIZATIONS, f"must be one of {', '.join(QUANTIZATIONS)}"),
            ("speculative", self.speculative in SPECULATIVE_MODES, f"must be one of {', '.join(SPECULATIVE_MODES)}"),
            (
                "speculative_max_tokens",
                _int(self.speculative_max_tokens) and 1 <= self.speculative_max_tokens <= 64,
                "must be an integer in [1, 64]",
            ),
            (
                "kv_cache_dir",
                self.kv_cache_dir is None
                or (isinstance(self.kv_cache_dir, (str, Path)) and str(self.kv_cache_dir) != ""),
                "must be a directory path or None",
            ),
            (
                "kv_cache_disk_gb",
                _number(self.kv_cache_disk_gb) and self.kv_cache_disk_gb > 0,
                "must be > 0",
            ),
            (
                "kv_cache_host_gb",
                self.kv_cache_host_gb is None or (_number(self.kv_cache_host_gb) and self.kv_cache_host_gb >= 0),
                "must be >= 0 or None",
            ),
            (
                "max_pinned_share",
                isinstance(self.max_pinned_share, (int, float)) and 0 <= self.max_pinned_share <= 1,
                "must be in [0, 1]",
            ),
            *(
                (name, _number(getattr(self, name)) and 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
                for name in ("max_retained_share", "max_retained_share_per_tenant")
            ),
            ("tp", _int(self.tp) and self.tp >= 1, "must be an integer >= 1"),
            ("null_model", isinstance(self.null_model, bool), "must be True or False"),
            (
                "deterministic",
                self.deterministic is None or isinstance(self.deterministic, bool),
                "must be True, False or None",
            ),
        ]

    @property
    def kv_cache_bytes(self) -> int | None:
        """kv_cache_gb in bytes (GiB, as kv_cache_disk_gb), or None."""
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * (1 << 30))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        unknown = set(kwargs) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
