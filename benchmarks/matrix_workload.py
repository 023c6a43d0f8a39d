"""The feature matrix's fixed workload, run under one combination of settings in a process of its own.

    python -m benchmarks.matrix_workload SETTINGS_JSON OUT_JSON MODEL_DIR [MODEL_DIR ...]

A process per combination, because two settings are process-wide: the CPU kernels (RADIXSERVE_CPU_KERNELS, read
once) and tensor parallelism (one group per process). For each model (tiny float32 checkpoints the tests build) it
runs every part of the workload below on one Engine and writes each part's output ids and logprobs to OUT_JSON,
with the check that every engine ended at rest, no page leaked. With the disk tier the engine is restarted half way,
on the same directory, so the second half reads what the first half spilled.

Parts: prompts sharing a prefix that ends mid-page, sent one after another; a three-turn conversation; n = 2; a
prompt long enough to be chunked; six prompts at once in a pool too small for them (eviction and retraction);
regex- and JSON-schema-constrained generations; copy-heavy text the n-gram drafter drafts from; a DSL program that
forks; and requests aborted mid-prefill and mid-decode (their outputs are not compared, the rest must not change).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

GREEDY = {"max_new_tokens": 12, "temperature": 0}
# what every request adds under the retention setting: kept 60 s past its last hit at priority 5
RETAINED = {"retention_seconds": 60.0, "retention_priority": 5}
PREFIX = [5 + (37 * i) % 400 for i in range(21)]  # 21 tokens: ends mid-page at page size 16


def engine_kwargs(settings: dict[str, Any], tier_dir: Path) -> dict[str, Any]:
    """The Engine arguments of one combination (see benchmarks/matrix.py FACTORS)."""
    tier = settings["tier"]
    return {
        # the deterministic leg at the default CPU setting of bf16 hardware: bf16 activations, int8 weights
        "dtype": "bfloat16" if settings["deterministic"] else "float32",
        "deterministic": settings["deterministic"],
        "tp": settings["tp"],
        "page_size": settings["page_size"],
        "enable_partial_page_reuse": settings["partial"],
        "enable_radix_cache": settings["radix"],
        "speculative": settings["speculative"],
        "overlap_schedule": settings["overlap"],
        "attention_backend": settings["backend"],
        "quantization": "gguf" if settings["quantization"] == "gguf-dense" else settings["quantization"],
        "kv_cache_dtype": settings.get("kv_dtype", "auto"),
        "kv_cache_dir": tier_dir if tier == "disk" else None,
        "kv_cache_host_gb": 0.002 if tier == "host" else 0,  # ~170 pages of 16 tokens of a tiny model
        "max_total_tokens": 384,  # small: the batch part evicts and retracts
        "chunked_prefill_size": 32,
        "max_running_requests": 8,
    }


def _result(out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    return {"ids": out["output_ids"], "logprobs": [lp for lp, _ in meta.get("output_token_logprobs") or []]}


def _gen(eng: Any, ids: Any, params: dict[str, Any] | None = None, **kw: Any) -> Any:
    return eng.generate(input_ids=ids, sampling_params=params or GREEDY, return_logprob=True, **kw)


def first_half(eng: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, tail in enumerate((5, 12, 30)):  # each hits the one before it part way through a page
        out[f"shared_prefix_{i}"] = _result(_gen(eng, PREFIX + [(11 * i + 3 * j) % 450 + 20 for j in range(tail)]))
    history = [7 + (13 * j) % 300 for j in range(40)]
    for turn in range(3):
        r = _gen(eng, history)
        out[f"turn_{turn}"] = _result(r)
        history = history + r["output_ids"] + [31 + turn, 17, 250 + turn]
    twins = _gen(eng, PREFIX + [99, 98, 97], {**GREEDY, "n": 2})
    out["n2"] = [_result(r) for r in twins]
    out["chunked"] = _result(_gen(eng, [3 + (29 * j) % 480 for j in range(150)]))
    return out


def second_half(eng: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batch = [PREFIX[:10] + [(5 * i + 7 * j) % 470 + 10 for j in range(50)] for i in range(6)]  # 6 x 76 > the pool
    out["pressure"] = [_result(r) for r in _gen(eng, batch, {**GREEDY, "max_new_tokens": 16})]
    out["again_shared_prefix"] = _result(_gen(eng, PREFIX + [20 + (3 * j) % 450 for j in range(12)]))
    copy = ([40, 41, 42, 43, 44, 45, 46, 47] * 6)[:45]
    out["copy_heavy"] = _result(_gen(eng, copy, {**GREEDY, "max_new_tokens": 24}))
    for name, params in (
        ("regex", {"regex": "[a-z]{2,6}( [a-z]{2,6}){2}"}),
        ("json_schema", {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}),
    ):
        r = eng.generate("constrained: ", {**GREEDY, "max_new_tokens": 24, **params}, return_logprob=True)
        out[name] = _result(r)
    out["aborted_others"] = asyncio.run(_with_aborts(eng))
    out["dsl_fork"] = _dsl_fork(eng)
    return out


async def _with_aborts(eng: Any) -> list[dict[str, Any]]:
    """Two requests aborted (one while its long prompt is prefilled in chunks, one while it decodes) beside two that
    run to the end: only theirs are compared."""
    long_params = {"max_new_tokens": 100, "ignore_eos": True}

    async def mid_prefill() -> None:
        ids = [9 + (17 * j) % 470 for j in range(200)]  # 7 chunks of 32; 300 tokens fit the pool of 384
        task = asyncio.ensure_future(eng.async_generate(input_ids=ids, sampling_params=long_params, rid="prefill"))
        await asyncio.sleep(0.02)
        eng.abort("prefill")
        await task

    async def mid_decode() -> None:
        seen = 0
        ids = PREFIX + [70, 71]
        async for _ in eng.async_generate(input_ids=ids, sampling_params=long_params, rid="decode", stream=True):
            seen += 1
            if seen == 3:
                eng.abort("decode")

    kept = [
        eng.async_generate(input_ids=PREFIX + [60 + i, 61, 62], sampling_params=GREEDY, return_logprob=True)
        for i in range(2)
    ]
    results = await asyncio.gather(mid_prefill(), mid_decode(), *kept)
    return [_result(r) for r in results[2:]]


def _dsl_fork(eng: Any) -> list[str]:
    import frontend_dsl as sgl
    from frontend_dsl.backends.runtime import Runtime

    @sgl.function
    def forked(s: Any) -> None:
        s += "A shared question about caching, then three answers:"
        branches = s.fork(3)
        for i, f in enumerate(branches):
            f += f" answer {i}:" + sgl.gen("a", max_tokens=8)
        branches.join()

    state = forked.run(backend=Runtime(engine=eng), temperature=0)
    return list(state["a"])


class Retaining:
    """An engine whose every request asks for retention (the matrix's retention setting), the DSL's included."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng

    def generate(self, *args: Any, **kw: Any) -> Any:
        return self.eng.generate(*args, **RETAINED, **kw)

    def async_generate(self, *args: Any, **kw: Any) -> Any:
        return self.eng.async_generate(*args, **RETAINED, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.eng, name)


def at_rest(eng: Any) -> None:
    """Nothing runs, the invariants hold, and a flush returns every page (no leak)."""
    import time

    deadline = time.monotonic() + 30
    while (m := eng.metrics())["num_running"] or m["num_waiting"]:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {m}")
        time.sleep(0.02)
    eng.check_invariants()


def run(settings: dict[str, Any], models: list[str]) -> dict[str, Any]:
    from radixserve import Engine

    wrap = Retaining if settings.get("retention") else (lambda eng: eng)
    results: dict[str, Any] = {}
    for model in models:
        with tempfile.TemporaryDirectory() as tier_dir:
            kwargs = engine_kwargs(settings, Path(tier_dir))
            eng = wrap(Engine(model=model, **kwargs))
            try:
                out = first_half(eng)
                if settings["tier"] == "disk":  # a restart in the middle: the rest reads what was spilled
                    at_rest(eng)
                    eng.shutdown()
                    eng = wrap(Engine(model=model, **kwargs))
                out |= second_half(eng)
                at_rest(eng)
                stats = eng.cache_stats()
                assert eng.flush_cache() and eng.cache_stats()["free_pages"] == stats["total_pages"], "page leak"
            finally:
                eng.shutdown()
        results[Path(model).name] = out
    return results


def main() -> None:
    settings, out_path, models = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    out_path.write_text(json.dumps(run(settings, models)))


if __name__ == "__main__":
    main()
