"""Run the comparison: each engine started as a server on 127.0.0.1, driven by the same replay client, stopped.

    .venv/bin/python -m benchmarks.compare --workload multiturn|rag|fork|nosharing|micro|all [--size full|quick|smoke]
        [--engines radix,radix-nocache,llama,hf] [--gguf PATH] [--hf-dir PATH] [--out DIR] [--plots DIR]

Engines that cannot run here (llama.cpp not installed by scripts/install_peers.sh, no GGUF) are skipped with the
reason. Writes results.json, results_raw.json (every request), results.md and PNG plots; prints the markdown.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare import engines as eng
from benchmarks.compare import fork, plots, report, workloads
from benchmarks.compare.client import Replay, Session
from benchmarks.compare.metrics import best_hit_tokens, summarize
from benchmarks.compare.micro import gguf_decode_bytes, hf_decode_bytes, measure_bandwidth, micro

WORKLOADS = ("multiturn", "rag", "fork", "nosharing", "micro")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    return f"{cpu}, {os.cpu_count()} cpus, {mem / 2**20:.0f} GiB, {platform.system()} {platform.release()}"


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=eng.REPO, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes in the tree)" if dirty else "")


def load1() -> float:
    return os.getloadavg()[0]


def default_models() -> tuple[Path | None, Path]:
    from radixserve.model.resolve import DEFAULT_GGUF_NAME, default_cache_dir

    cache = default_cache_dir()
    return cache / DEFAULT_GGUF_NAME, cache / DEFAULT_GGUF_NAME.removesuffix("-q4_k_m.gguf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(WORKLOADS)}, all, or a comma list")
    ap.add_argument("--engines", default=",".join(eng.ENGINES), help="comma list of " + ", ".join(eng.ENGINES))
    ap.add_argument("--size", default="full", choices=sorted(workloads.SIZES))
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the default model's); 'none' for no GGUF")
    ap.add_argument("--hf-dir", default=None, help="the same model as a HF folder (default: the converted default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="KV cache size of every engine, in tokens")
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/out/compare-<time>)")
    ap.add_argument("--plots", default=None, help="plot folder (default: the output folder)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    args.workloads = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)} or all")
    return args


def run_one(server: eng.Server, sessions: list[Session], concurrency: int, tok: Any) -> tuple[dict[str, Any], list]:
    """Replay sessions on a running server; the summary row (with the best possible hit rate) and the raw results."""
    load_start = load1()
    replay = Replay(server.url, concurrency)
    wall = asyncio.run(replay.run(sessions))
    row = summarize(replay.results, wall)
    best, total = best_hit_tokens(tok, replay.results)
    row |= {"best_hit_rate": best / max(total, 1), "peak_rss_mb": server.peak_rss_mb(), "load_start": load_start,
            "load_end": load1()}
    return row, [dataclasses.asdict(r) for r in replay.results]


def main(argv: list[str] | None = None) -> int:
    """Run the chosen workloads on the chosen engines; returns 0 (an engine's failure is recorded, not raised)."""
    args = parse_args(argv)
    from radixserve.tokenizer import Tokenizer

    gguf, hf_dir = default_models()
    gguf = None if args.gguf == "none" else Path(args.gguf) if args.gguf else gguf
    hf_dir = Path(args.hf_dir) if args.hf_dir else hf_dir
    models = eng.Models(gguf if gguf and gguf.exists() else None, hf_dir, args.threads, args.kv_tokens)
    size = workloads.SIZES[args.size]
    tok = Tokenizer.from_dir(hf_dir)
    out = Path(args.out) if args.out else eng.REPO / "benchmarks" / "out" / time.strftime("compare-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    engines = []
    for e in sorted(args.engines.split(","), key=lambda e: eng.ENGINES.index(e) if e in eng.ENGINES else 99):
        why = eng.unavailable_reason(e, models)
        if why:
            print(f"skipping {e}: {why}", file=sys.stderr)
        else:
            engines.append(e)
    doc: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(), "commit": commit(),
        "command": "python -m benchmarks.compare " + shlex.join(sys.argv[1:] if argv is None else argv),
        "load_start": load1(), "size": args.size, "engines": engines,
        "size_detail": ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(size).items()),
        "models": {"gguf": str(models.gguf), "hf_dir": str(hf_dir)}}, "workloads": {}, "dsl": {}}
    raw: dict[str, Any] = {}
    trace: list[list[fork.Call]] | None = None

    for w in args.workloads:
        if w == "micro":
            doc["micro"] = run_micro(engines, models, tok, size, out)
            continue
        rows = doc["workloads"].setdefault(w, {})
        for e in engines:
            if w == "fork" and trace is None and not e.startswith("radix"):
                rows[e] = {"error": "the fork workload is recorded on radixserve: include radix or radix-nocache"}
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {w} on {e} ...", file=sys.stderr, flush=True)
            server = None
            try:
                server = eng.start(e, models, out / "logs")
                if w == "fork":
                    sessions, conc = None, size.fork_concurrency
                    if e.startswith("radix"):  # the DSL program itself, natively; the first run is recorded
                        programs, wall, hits = fork.run_programs(server.url, size.fork_tasks)
                        doc["dsl"][e] = {"wall_s": wall, **hits}
                        trace = trace or programs
                        eng.flush(server)
                    sessions = fork.sessions(trace)
                else:
                    sessions, conc = getattr(workloads, w)(tok, size)
                rows[e], raw[f"{w}/{e}"] = run_one(server, sessions, conc, tok)
            except Exception as exc:  # one engine failing must not lose the others' figures
                rows[e] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{w} on {e} failed: {exc}", file=sys.stderr)
            finally:
                if server is not None:
                    server.stop()
    doc["meta"]["load_end"] = load1()
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results_raw.json").write_text(json.dumps(raw))
    md = report.markdown(doc)
    if not args.no_plots:
        made = plots.all_plots(doc, Path(args.plots) if args.plots else out)
        md += "\n" + "\n".join(f"![{p.stem}]({p})" for p in made) + "\n"
    (out / "results.md").write_text(md)
    print(md)
    print(f"written to {out}", file=sys.stderr)
    return 0


def run_micro(engines: list[str], models: eng.Models, tok: Any, size: workloads.Size, out: Path) -> dict[str, Any]:
    """The micro-benchmark on every engine, with the bandwidth measured now (same run)."""
    res: dict[str, Any] = {"bandwidth_gb_s": measure_bandwidth(models.threads), "threads": models.threads,
                           "engines": {}}
    for e in engines:
        if e == "radix-nocache":
            continue  # the cache changes nothing here: distinct prompts
        print(f"[{time.strftime('%H:%M:%S')}] micro on {e} ...", file=sys.stderr, flush=True)
        server = None
        try:
            server = eng.start(e, models, out / "logs", parallel=max(size.micro_batches))
            r = micro(server.url, tok, size)
            fmt_bytes = gguf_decode_bytes(models.gguf) if e == "llama" else hf_decode_bytes(models.hf_dir)
            r |= {"decode_bytes": fmt_bytes, "ceiling_tok_s": res["bandwidth_gb_s"] * 1e9 / fmt_bytes,
                  "peak_rss_mb": server.peak_rss_mb()}
            res["engines"][e] = r
        except Exception as exc:
            res["engines"][e] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"micro on {e} failed: {exc}", file=sys.stderr)
        finally:
            if server is not None:
                server.stop()
    return res


if __name__ == "__main__":
    sys.exit(main())
