"""The start-up summary `radixserve serve` and `radixserve chat` print: what runs, with what memory, and where."""

from __future__ import annotations

from typing import Any


def startup_summary(engine: Any, url: str | None = None, api_key: bool | str | None = False) -> str:
    """One screen: model, architecture, dtype, device and attention backend, KV pool, context, sampling defaults,
    and for a server its URL and whether it needs a key."""
    info, pool, cfg = engine.model_info(), engine.runner.pool, engine.runner.config
    pool_bytes = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    defaults = ", ".join(f"{k}={v}" for k, v in info["sampling_defaults"].items()) or "none (temperature 1)"
    rows = [
        ("model", f"{info['model_name']} ({info['model_path']})"),
        ("architecture", f"{cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size}"),
        ("dtype / device", f"{info['dtype']} on {engine.device}, attention: {info['attention_backend']}"),
        ("weights", f"{info['quantization']} ({info['quantization_reason']})"),
        (
            "KV pool",
            f"{pool.capacity * pool.page_size:,} tokens in {pool.capacity:,} pages of {pool.page_size} "
            f"({pool_bytes / 2**30:.2f} GiB, {info['kv_cache_dtype']})",
        ),
        ("context", f"{info['context_length']:,} tokens"),
        *(
            [
                (
                    "tensor parallel",
                    f"{info['tp']} ranks, each with its shard of the weights and a KV pool of its heads "
                    "(the KV pool above is rank 0's)",
                )
            ]
            if info.get("tp", 1) > 1
            else []
        ),
        ("sampling defaults", defaults),
    ]
    if url is not None:
        rows += [
            ("URL", f"{url}  (OpenAI API at {url}/v1, model name {info['model_name']!r} or 'default')"),
            ("API key", api_key if isinstance(api_key, str) else "required" if api_key else "off"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
