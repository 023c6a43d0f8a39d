"""Retention under API keys over HTTP: each key retains within its own share of the pool (another key's retentions
neither count against it nor displace it), and /metrics shows every key's retained pages, bytes and limit to the
admin, and to a user key only its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_checks import engine_left_at_rest
from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from radixserve.server.tenants import KeyRing, KeySources

KEYS = {
    "ops": "sk-ops-0001 name=ops role=admin",
    "alice": "sk-alice-0002 name=alice role=user",
    "bob": "sk-bob-0003 name=bob role=user",
}
# 256 pages of 4 tokens; a tenant may retain int(0.05 * 256) = 12 pages, the pool 128.
POOL = {"page_size": 4, "max_total_tokens": 1024, "max_retained_share": 0.5, "max_retained_share_per_tenant": 0.05}
PER_KEY = 12


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(tiny_model_dir, dtype="float32", **POOL) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine, api_key=KeyRing(KeySources(cli=tuple(KEYS.values()))))) as srv:
        yield srv


def call(server: BackgroundServer, who: str, method: str, path: str, **kw: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[who].split()[0]}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        r = c.request(method, path, **kw)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return r


def retain(server: BackgroundServer, who: str, ids: list[int]) -> None:
    """Generate 4 tokens after `ids` and retain prompt + output (len(ids) + 3 tokens have KV)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "retention_seconds": 300}
    call(server, who, "POST", "/generate", json=body)


def scrape(server: BackgroundServer, who: str) -> dict[tuple[str, str], float]:
    """(sample name, key label or "") -> value."""
    text = call(server, who, "GET", "/metrics").text
    return {(s.name, s.labels.get("key", "")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_each_key_retains_within_its_own_share_and_reads_only_its_own(server: BackgroundServer) -> None:
    retain(server, "bob", list(range(100, 137)))  # 40 tokens with KV: 10 pages
    m = scrape(server, "ops")
    page_bytes = m[("radixserve_retained_bytes", "")] / m[("radixserve_retained_pages", "")]
    assert m[("radixserve_key_retained_pages", "bob")] == 10
    assert m[("radixserve_key_retained_bytes", "bob")] == 10 * page_bytes
    assert m[("radixserve_key_retained_pages", "alice")] == 0
    assert m[("radixserve_key_retained_pages_limit", "alice")] == PER_KEY

    # Alice retains 5 prompts of 10 pages each: 50 pages, 4 times her share. She stays within it (her newest
    # retention displaces her older ones), and Bob's retention is neither displaced nor charged for it.
    for i in range(5):
        retain(server, "alice", list(range(200 + 40 * i, 237 + 40 * i)))
        m = scrape(server, "ops")
        assert 10 <= m[("radixserve_key_retained_pages", "alice")] <= PER_KEY
        assert m[("radixserve_key_retained_pages", "bob")] == 10
    refused = m[("radixserve_retentions_refused_total", "")]
    retain(server, "alice", list(range(400, 457)))  # 15 pages: more than her whole share, refused
    m = scrape(server, "ops")
    assert m[("radixserve_retentions_refused_total", "")] == refused + 1
    assert m[("radixserve_retained_pages", "")] == m[("radixserve_key_retained_pages", "alice")] + 10

    own = scrape(server, "alice")
    assert ("radixserve_key_retained_pages", "alice") in own
    assert not any(key == "bob" for _, key in own), "another key's retention stays hidden from a user key"
    assert ("radixserve_retained_pages", "") not in own, "so does the pool-wide figure"
