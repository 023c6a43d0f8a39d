"""Small PNG plots of a run (matplotlib, Agg): TTFT per turn, throughput against concurrency, per-workload summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.compare.report import step_tags

COLORS = {"radix": "tab:green", "radix-nocache": "tab:olive", "llama": "tab:blue", "hf": "tab:red"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_per_step(name: str, rows: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """TTFT p50 (lines) and p95 (dashed) per step (turn, document...) per engine; None if the workload has one step."""
    engines, tags = step_tags(rows)
    if len(tags) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for e in engines:
        xs = [t for t in tags if t in rows[e]["by_tag"]]
        color = COLORS.get(e)
        ax.plot(xs, [rows[e]["by_tag"][t]["ttft_p50_ms"] for t in xs], "o-", color=color, label=f"{e} p50")
        ax.plot(xs, [rows[e]["by_tag"][t]["ttft_p95_ms"] for t in xs], "x--", color=color, alpha=0.6, label=f"{e} p95")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT ms (log)")
    ax.set_title(f"{name}: time to first token per step")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def throughput_vs_concurrency(micro: dict[str, Any], path: Path) -> Path:
    """Decode tokens/s against batch size (concurrent requests) per engine, with the batch-1 bandwidth ceilings."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    ceilings: dict[float, list[str]] = {}  # engines reading the same weight bytes share one ceiling line
    batches: set[int] = set()
    for e, r in micro["engines"].items():
        if "decode_tok_s" not in r:
            continue
        bs = sorted(r["decode_tok_s"], key=int)
        batches |= {int(b) for b in bs}
        ax.plot([int(b) for b in bs], [r["decode_tok_s"][b] for b in bs], "o-", color=COLORS.get(e), label=e)
        if r.get("ceiling_tok_s"):
            ceilings.setdefault(round(r["ceiling_tok_s"], 1), []).append(e)
    for value, names in ceilings.items():
        ax.axhline(
            value, color=COLORS.get(names[0]), ls=":", lw=1, label=f"{'/'.join(names)}: bandwidth ceiling @ batch 1"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.set_xlabel("concurrent requests (decode batch)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput vs concurrency ({micro['bandwidth_gb_s']:.0f} GB/s memory)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summary(workloads: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path:
    """Grouped bars per workload: TTFT p50, TTFT p95 (log scales) and output tokens/s, one bar per engine."""
    plt = _plt()
    names = list(workloads)
    engines = list(dict.fromkeys(e for rows in workloads.values() for e in rows))
    metrics = [
        ("ttft_p50_ms", "TTFT p50 ms", True),
        ("ttft_p95_ms", "TTFT p95 ms", True),
        ("output_tok_s", "output tok/s", False),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=90)
    width = 0.8 / max(len(engines), 1)
    for ax, (key, label, log) in zip(axes, metrics):
        for k, e in enumerate(engines):
            vals = [workloads[n].get(e, {}).get(key) or 0 for n in names]
            ax.bar([i + k * width for i in range(len(names))], vals, width, color=COLORS.get(e), label=e)
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(names))], names, fontsize=8)
        ax.set_title(label, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def all_plots(doc: dict[str, Any], out: Path, prefix: str = "") -> list[Path]:
    """Every plot the run has data for, into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, rows in doc["workloads"].items():
        p = ttft_per_step(name, rows, out / f"{prefix}{name}_ttft_per_step.png")
        if p:
            made.append(p)
    if doc["workloads"]:
        made.append(summary(doc["workloads"], out / f"{prefix}workloads_summary.png"))
    if doc.get("micro", {}).get("engines"):
        made.append(throughput_vs_concurrency(doc["micro"], out / f"{prefix}throughput_vs_concurrency.png"))
    return made
