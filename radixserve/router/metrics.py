"""/metrics of the router: every worker's Prometheus samples summed, each worker's own with a `worker` label, and the
router's counters (decisions by reason, retries, failures, health, load, tree size).

Counters, gauges of amounts (pages, running requests) and histogram buckets/sums/counts add up across workers.
A ratio does not: radixserve_hit_rate is recomputed from the summed cached and prompt token counters.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.router.policy import CacheAware
from radixserve.router.state import Router
from radixserve.router.workers import Worker

RATIOS = {"radixserve_hit_rate": ("radixserve_cached_tokens_total", "radixserve_prompt_tokens_total")}


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


async def scrape(client: httpx.AsyncClient, worker: Worker, timeout: float) -> str | None:
    try:
        r = await client.get(worker.url + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def merge(texts: dict[str, str]) -> list[str]:
    """Prometheus text of the summed families, then each worker's samples labelled with its URL."""
    meta: dict[str, tuple[str, str]] = {}  # family -> (type, help)
    summed: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))  # family -> (sample, labels)
    per_worker: dict[str, list[tuple[str, dict, float]]] = defaultdict(list)
    for url, text in texts.items():
        for fam in text_string_to_metric_families(text):
            meta.setdefault(fam.name, (fam.type, fam.documentation))
            for s in fam.samples:
                if s.name.endswith("_created"):  # a start timestamp: neither summed nor worth copying
                    continue
                summed[fam.name][s.name, tuple(sorted(s.labels.items()))] += s.value
                per_worker[fam.name].append((s.name, {**s.labels, "worker": url}, s.value))
    totals = {name: v for fam in summed.values() for (name, labels), v in fam.items() if not labels}
    lines = []
    for fam, samples in summed.items():
        kind, doc = meta[fam]
        lines += [f"# HELP {fam} {doc}", f"# TYPE {fam} {kind}"]
        for (name, labels), v in samples.items():
            if name in RATIOS:
                num, den = (totals.get(n, 0.0) for n in RATIOS[name])
                v = num / den if den else 0.0
            lines.append(f"{name}{_labels(dict(labels))} {_num(v)}")
        lines += [f"{name}{_labels(labels)} {_num(v)}" for name, labels, v in per_worker[fam]]
    return lines


def router_lines(router: Router) -> list[str]:
    p = "radixserve_router_"
    lines = [
        f"# HELP {p}requests_total requests routed, by worker and decision reason",
        f"# TYPE {p}requests_total counter",
    ]
    lines += [f"{p}requests_total{_labels({'worker': u, 'reason': r})} {n}" for (u, r), n in router.decisions.items()]
    lines += [
        f"# HELP {p}retries_total requests sent to another worker after one failed",
        f"# TYPE {p}retries_total counter",
        f"{p}retries_total {router.retries}",
        f"# HELP {p}worker_failures_total requests a worker failed (refused, dropped, 502-504)",
        f"# TYPE {p}worker_failures_total counter",
    ]
    lines += [f"{p}worker_failures_total{_labels({'worker': u})} {n}" for u, n in router.worker_failures.items()]
    tree = router.policy.tree if isinstance(router.policy, CacheAware) else None
    for name, doc, get in (
        ("worker_healthy", "1 while the worker takes traffic", lambda w: int(w.healthy)),
        ("worker_load", "requests in flight on the worker", lambda w: w.load),
        (
            "tree_chars",
            "characters of prompt text the approximate tree holds for the worker",
            lambda w: tree.size(w.url) if tree else 0,
        ),
    ):
        lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} gauge"]
        lines += [f"{p}{name}{_labels({'worker': w.url})} {get(w)}" for w in router.pool.all()]
    return lines


async def render(router: Router) -> str:
    workers = router.pool.all()
    texts = await asyncio.gather(*(scrape(router.client, w, router.config.health_timeout_s) for w in workers))
    merged = merge({w.url: t for w, t in zip(workers, texts) if t is not None})
    return "\n".join(merged + router_lines(router)) + "\n"
