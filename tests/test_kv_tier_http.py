"""Pinning and the disk tier over HTTP and in the DSL: /cache/pin, /cache/unpin, `pin: true` on /generate, the tier's
figures in /metrics, API keys as separate namespaces on disk, and sgl.pin / sgl.unpin on both DSL backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import frontend_dsl as sgl
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.tenants import parse_entry

POOL = {"page_size": 4, "max_total_tokens": 96, "max_pinned_share": 0.5}
PROMPT = list(range(300, 340))  # 10 pages


def gauges(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {s.name: s.value for f in families for s in f.samples}


def test_pin_endpoints_and_pin_on_generate(make_engine: Callable, tiny_model_dir: Path, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    with BackgroundServer(build_app(eng)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/cache/pin", json={"input_ids": PROMPT})
        assert r.status_code == 200 and r.json() == {"success": True, "pinned_tokens": 40, "prompt_tokens": 40}
        assert gauges(http)["radixserve_pinned_pages"] == 10
        r = http.post("/cache/pin", json={"input_ids": list(range(100, 120))})  # 5 more pages: over 12
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
        assert "over the limit" in r.json()["error"]["message"]
        assert http.post("/cache/pin", json={}).status_code == 400
        assert http.post("/cache/unpin", json={"input_ids": PROMPT}).json() == {"success": True}
        assert http.post("/cache/unpin", json={"input_ids": PROMPT}).json() == {"success": False}
        r = http.post(
            "/generate",
            json={"input_ids": PROMPT[:8], "pin": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        )
        assert r.status_code == 200 and gauges(http)["radixserve_pinned_pages"] == 2
        r = http.post(
            "/v1/completions",
            json={
                "model": eng.model_info()["model_name"],
                "prompt": PROMPT[:12],
                "max_tokens": 2,
                "temperature": 0,
                "pin": True,
            },
        )
        assert r.status_code == 200 and gauges(http)["radixserve_pinned_pages"] == 3  # shares the 2 above
        m = gauges(http)
        for name in (
            "radixserve_disk_pages",
            "radixserve_disk_bytes",
            "radixserve_device_bytes",
            "radixserve_spilled_pages_total",
            "radixserve_loaded_pages_total",
            "radixserve_disk_hit_tokens_total",
            "radixserve_load_seconds_total",
            "radixserve_host_pages",
            "radixserve_host_bytes",
            "radixserve_host_hit_tokens_total",
            "radixserve_host_spilled_pages_total",
            "radixserve_host_loaded_pages_total",
            "radixserve_host_load_seconds_total",
        ):
            assert name in m, name
        assert http.post("/flush_cache").status_code == 200
        assert gauges(http)["radixserve_pinned_pages"] == 0


def test_api_keys_stay_apart_on_disk_across_a_restart(
    make_engine: Callable, tiny_model_dir: Path, tmp_path: Path
) -> None:
    body = {"input_ids": PROMPT + [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    with BackgroundServer(build_app(first, api_key="key-a,key-b")) as srv:
        r = httpx.post(srv.url + "/generate", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60)
        assert r.status_code == 200
    first.check_invariants()
    first.shutdown()
    second = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, **POOL)
    with BackgroundServer(build_app(second, api_key="key-a,key-b")) as srv:
        for key, hit in (("key-b", 0), ("key-a", 40)):
            r = httpx.post(srv.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.json()["meta_info"]["cached_tokens"] == hit, key


@pytest.mark.parametrize("kind", ["runtime", "endpoint"])
def test_dsl_pin(make_engine: Callable, tiny_model_dir: Path, kind: str) -> None:
    eng = make_engine(tiny_model_dir, **POOL)
    text = "pin me " * 5
    with BackgroundServer(build_app(eng)) as srv:
        backend = sgl.Runtime(engine=eng) if kind == "runtime" else sgl.RuntimeEndpoint(srv.url)
        out = sgl.pin(text, backend=backend)
        assert out["pinned_tokens"] == out["prompt_tokens"] // 4 * 4 > 0
        assert eng.cache_stats()["pinned_pages"] == out["pinned_tokens"] // 4
        assert sgl.unpin(text, backend=backend) and not sgl.unpin(text, backend=backend)


def test_a_user_flush_drops_its_own_pages_in_every_tier(
    make_engine: Callable, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 21's roles: a user key's /flush_cache empties its namespace in the pool, the host tier and on disk;
    another user's pages stay in both tiers."""
    eng = make_engine(tiny_model_dir, kv_cache_dir=tmp_path, kv_cache_host_gb=8 * 3072 / (1 << 30), **POOL)
    entries = {"a": "sk-a-01 name=a role=user", "b": "sk-b-02 name=b role=user"}
    ns = {name: parse_entry(e, "user", "test").principal.namespace for name, e in entries.items()}
    body = {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    def held() -> dict[str, int]:
        tier = eng.tier
        found = [e.namespace for e in tier.store.index.values()] + [e.namespace for _, e in tier.host.items()]
        return {name: found.count(n) for name, n in ns.items()}

    with BackgroundServer(build_app(eng, api_key=list(entries.values()))) as srv:
        for key, start in (("sk-a-01", 0), ("sk-b-02", 0), ("sk-a-01", 100)):  # 6 x 10 pages for a pool of 24
            for i in range(2):
                ids = list(range(start + i * 40, start + i * 40 + 41))
                r = httpx.post(
                    srv.url + "/generate",
                    json={**body, "input_ids": ids},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=60,
                )
                assert r.status_code == 200
        before = held()
        assert before["a"] > 0 and before["b"] > 0, before
        r = httpx.post(srv.url + "/flush_cache", headers={"Authorization": "Bearer sk-a-01"}, timeout=60)
        assert r.status_code == 200 and r.json()["flushed_pages"] > before["a"]  # its pool pages too
        assert held() == {"a": 0, "b": before["b"]}
    eng.check_invariants()
