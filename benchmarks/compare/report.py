"""Results as markdown tables (one per workload, the micro-benchmark, the goals) from the run's JSON document."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return "nan" if x != x else f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _oneline(text: str, limit: int = 200) -> str:
    """An error message fit for one table cell."""
    return " ".join(text.split()).replace("|", "/")[:limit]


def _mem(r: dict[str, Any]) -> str:
    return f"{_f(r.get('rss_mb'), 0)} / {_f(r.get('peak_rss_mb'), 0)}"


def _engine_table(
    title: str, head: str, rows: dict[str, dict[str, Any]], cells: Callable[[dict[str, Any]], str]
) -> str:
    """`title`, then table `head` with one line per engine: its latency and throughput, `cells(row)` (what the
    workload and guidellm tables differ in), its load; or its error."""
    lines = [title, "", head, "|" + "---|" * (head.count("|") - 1)]
    for engine, r in rows.items():
        if "error" in r:
            lines.append(f"| {engine} | failed: {_oneline(r['error'])} |" + " |" * (head.count("|") - 3))
            continue
        lines.append(
            f"| {engine} | {_f(r['ttft_p50_ms'], 0)} | {_f(r['ttft_p95_ms'], 0)} | {_f(r['itl_p50_ms'], 0)} "
            f"| {_f(r['req_s'], 2)} | {_f(r['output_tok_s'])} | {cells(r)} "
            f"| {_f(r['load_start'], 1)}-{_f(r['load_end'], 1)} |"
        )
    return "\n".join(lines)


def workload_table(name: str, rows: dict[str, dict[str, Any]]) -> str:
    """One line per engine: latency, throughput, prompt tokens computed/cached, hit rate vs best, peak RSS."""
    head = (
        "| engine | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | req/s | out tok/s | prompt tok computed / from cache "
        "| hit rate (best possible) | RSS after / peak MiB | wall s | load 1m |"
    )

    def cells(r: dict[str, Any]) -> str:
        computed = "n/a" if r["computed_tokens"] is None else f"{r['computed_tokens']:,} / {r['cached_tokens']:,}"
        hit = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.1%} ({r['best_hit_rate']:.1%})"
        return f"{computed} | {hit} | {_mem(r)} | {_f(r['wall_s'])}"

    return _engine_table(f"**{name}**", head, rows, cells)


def step_tags(rows: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The engines with figures per tag (turn, document, fork stage), and every tag in the order first seen."""
    engines = [e for e, r in rows.items() if "by_tag" in r]
    return engines, list(dict.fromkeys(t for e in engines for t in rows[e]["by_tag"]))


def tag_table(name: str, rows: dict[str, dict[str, Any]]) -> str:
    """TTFT p50 per tag (turn, document, fork stage) and engine."""
    engines, tags = step_tags(rows)
    if len(tags) < 2:
        return ""
    lines = [
        f"TTFT p50 ms per {name} step",
        "",
        "| engine | " + " | ".join(tags) + " |",
        "|---" * (len(tags) + 1) + "|",
    ]
    for e in engines:
        lines.append(
            f"| {e} | " + " | ".join(_f(rows[e]["by_tag"].get(t, {}).get("ttft_p50_ms"), 0) for t in tags) + " |"
        )
    return "\n".join(lines)


def guidellm_table(name: str, rows: dict[str, dict[str, Any]]) -> str:
    """guidellm's own figures per engine (its synthetic version of the workload; compare only within this table)."""
    head = (
        "| engine | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | req/s | out tok/s | requests ok / failed "
        "| RSS after / peak MiB | load 1m |"
    )
    return _engine_table(
        f"**{name}, under guidellm**", head, rows, lambda r: f"{r['successful']} / {r['errored']} | {_mem(r)}"
    )


def micro_table(micro: dict[str, Any]) -> str:
    """Prefill and decode tokens/s per engine, beside the bandwidth ceiling of its weight format."""
    rows = micro["engines"]
    batches = list(dict.fromkeys(b for r in rows.values() if "decode_tok_s" in r for b in r["decode_tok_s"]))
    lines = [
        f"Memory read bandwidth ({micro['threads']} threads, best sum over 1 GiB): {micro['bandwidth_gb_s']:.1f} GB/s; "
        "ceiling = bandwidth / weight bytes one decode step reads"
        + (
            f"; llama-server's slots (-np): {micro['llama_slots']}, streams past them queue"
            if any(e.startswith("llama") for e in rows) and micro.get("llama_slots")
            else ""
        ),
        "",
        "| engine | prefill tok/s | "
        + " | ".join(f"decode tok/s @ batch {b}" for b in batches)
        + " | weights read per decode step MB | bandwidth ceiling @ batch 1 tok/s | batch 1 / ceiling |",
        "|---" * (len(batches) + 5) + "|",
    ]
    for engine, r in rows.items():
        if "error" in r:
            lines.append(f"| {engine} | failed: {_oneline(r['error'])} |")
            continue
        d = r["decode_tok_s"]
        ceiling = r.get("ceiling_tok_s")
        share = "n/a" if not ceiling or "1" not in d else f"{d['1'] / ceiling:.0%}"
        lines.append(
            f"| {engine} | {_f(r['prefill_tok_s'])} | "
            + " | ".join(_f(d.get(b)) for b in batches)
            + f" | {_f(r.get('decode_bytes', 0) / 1e6, 0)} | {_f(ceiling)} | {share} |"
        )
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def goals(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for each goal of issue 6 that this run has the figures for."""
    out = []
    w = doc["workloads"]
    for name in ("multiturn", "rag"):
        rows = w.get(name, {})
        rx, ll = rows.get("radix", {}), rows.get("llama", {})
        if "ttft_p50_ms" in rx and "ttft_p50_ms" in ll:
            for p in ("p50", "p95"):
                r = _ratio(rx[f"ttft_{p}_ms"], ll[f"ttft_{p}_ms"])
                out.append(
                    (
                        f"{name}: radix TTFT {p} <= 1/3 of llama.cpp's",
                        f"{r:.2f}x",
                        "met" if r is not None and r <= 1 / 3 else "gap",
                    )
                )
            r = _ratio(rx["output_tok_s"], ll["output_tok_s"])
            out.append((f"{name}: radix output tok/s >= llama.cpp's", f"{r:.2f}x", "met" if r and r >= 1 else "gap"))
    for name, rows in w.items():
        rx = rows.get("radix", {})
        if rx.get("hit_rate") is not None and rx.get("best_hit_rate", 0) >= 0.01:  # else nothing to reuse
            r = rx["hit_rate"] / rx["best_hit_rate"]
            out.append(
                (
                    f"{name}: radix hit rate >= 95% of best possible",
                    f"{rx['hit_rate']:.1%} of {rx['best_hit_rate']:.1%} = {r:.0%}",
                    "met" if r >= 0.95 else "gap",
                )
            )
    rows = w.get("nosharing", {})
    on, off = rows.get("radix", {}), rows.get("radix-nocache", {})
    if "output_tok_s" in on and "output_tok_s" in off:
        r = _ratio(on["output_tok_s"], off["output_tok_s"])
        t = _ratio(on["ttft_p50_ms"], off["ttft_p50_ms"])
        ok = r is not None and r >= 0.95 and t is not None and t <= 1.05
        out.append(
            (
                "nosharing: cache on within 5% of off (out tok/s, TTFT p50)",
                f"{r:.3f}x tok/s, {t:.3f}x TTFT",
                "met" if ok else "gap",
            )
        )
    m = doc.get("micro", {}).get("engines", {})
    rx, ll = m.get("radix", {}).get("decode_tok_s", {}), m.get("llama", {}).get("decode_tok_s", {})
    if "1" in rx and "1" in ll:
        r = rx["1"] / ll["1"]
        out.append(("decode batch 1 >= 1/2 of llama.cpp's", f"{r:.2f}x", "met" if r >= 0.5 else "gap"))
    big = max((b for b in rx if b in ll), key=int, default=None)
    if big is not None and big != "1":
        r = rx[big] / ll[big]
        out.append((f"decode batch {big} ahead of llama.cpp", f"{r:.2f}x", "met" if r > 1 else "gap"))
    return out


def _peak_rss(doc: dict[str, Any], engine: str) -> float | None:
    """An engine's highest peak RSS over the run's servers (each workload starts a fresh one)."""
    rows = [
        *(w.get(engine, {}) for w in doc["workloads"].values()),
        doc.get("micro", {}).get("engines", {}).get(engine, {}),
    ]
    peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb") is not None]
    return max(peaks) if peaks else None


def speed_goals(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for issue 14's goals, radix at its defaults against llama.cpp, where measured."""
    checks: list[tuple[str, float | None, bool]] = []  # (goal, radix / llama, True if higher is better)
    m = doc.get("micro", {}).get("engines", {})
    rx, ll = m.get("radix", {}), m.get("llama", {})
    d_rx, d_ll = rx.get("decode_tok_s", {}), ll.get("decode_tok_s", {})
    checks.append(("decode, 1 stream >= 1.0x", _ratio(d_rx.get("1"), d_ll.get("1")), True))
    big = max((b for b in d_rx if b in d_ll and b != "1"), key=int, default=None)
    if big is not None:
        checks.append((f"decode, {big} streams >= 1.5x", _ratio(d_rx[big], d_ll[big]), True))
    checks.append(("prefill tok/s >= 1.5x", _ratio(rx.get("prefill_tok_s"), ll.get("prefill_tok_s")), True))
    mt = doc["workloads"].get("multiturn", {})
    mrx, mll = mt.get("radix", {}), mt.get("llama", {})
    checks += [
        ("multi-turn TTFT p50 <= 0.5x", _ratio(mrx.get("ttft_p50_ms"), mll.get("ttft_p50_ms")), False),
        ("multi-turn TTFT p95 <= 0.33x", _ratio(mrx.get("ttft_p95_ms"), mll.get("ttft_p95_ms")), False),
        ("multi-turn workload wall <= 1.0x", _ratio(mrx.get("wall_s"), mll.get("wall_s")), False),
        ("peak RSS <= 1.5x", _ratio(_peak_rss(doc, "radix"), _peak_rss(doc, "llama")), False),
    ]
    out = []
    for goal, r, higher in checks:
        if r is None:
            continue
        bound = float(goal.rsplit(" ", 1)[1].rstrip("x"))
        out.append((goal, f"{r:.2f}x", "met" if (r >= bound if higher else r <= bound) else "gap"))
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The whole run as markdown: provenance, one table per workload, the micro-benchmark, the goals."""
    meta = doc["meta"]
    parts = [
        f"- Date: {meta['date']}. Machine: {meta['machine']}. CPU flags: {meta.get('cpu_flags', 'n/a')}. "
        f"Commit: {meta['commit']}.",
        f"- Command: `{meta['command']}`",
        f"- Load average (1 min) at start {meta['load_start']:.1f}, at end {meta['load_end']:.1f}.",
        f"- Sizes ({meta['size']}): {meta['size_detail']}",
        "",
    ]
    for name, rows in doc["workloads"].items():
        parts += [workload_table(name, rows), ""]
        extra = tag_table(name, rows)
        if extra:
            parts += [extra, ""]
        dsl = doc.get("dsl", {})
        if name == "fork" and dsl:
            parts += [
                "DSL program run natively on radixserve (the run the replay was recorded from): "
                + "; ".join(f"{e}: {d['wall_s']:.1f} s, hit rate {d['hit_rate']:.1%}" for e, d in dsl.items()),
                "",
            ]
    for name, rows in doc.get("guidellm", {}).items():
        parts += [guidellm_table(name, rows), ""]
    if doc.get("micro"):
        parts += ["**micro**", "", micro_table(doc["micro"]), ""]
    g = goals(doc)
    if g:
        parts += ["| goal | measured | verdict |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in g] + [""]
    s = speed_goals(doc)
    if s:
        parts += ["| issue 14 goal: radix defaults vs llama.cpp | measured | verdict |", "|---|---|---|"]
        parts += [f"| {a} | {b} | {c} |" for a, b, c in s]
    return "\n".join(parts) + "\n"
