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
from collections.abc import Callable
from typing import Any

import radixserve_kernels.cpu
from benchmarks.compare import engines as eng
from benchmarks.compare import fork, guidellm_run, plots, report, workloads
from benchmarks.compare.client import Replay, Session
from benchmarks.compare.metrics import best_hit_tokens, summarize
from benchmarks.compare.micro import (
    gguf_decode_bytes,
    hf_decode_bytes,
    measure_bandwidth,
    micro,
    radix_bytes_per_param,
)

WORKLOADS = ("multiturn", "rag", "fork", "nosharing", "micro")


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    mem = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    return f"{cpu}, {os.cpu_count()} cpus, {mem / 2**20:.0f} GiB, {platform.system()} {platform.release()}"


def cpu_flags() -> str:
    """The SIMD flags that decide radixserve's CPU kind (AVX2 / AVX-512 / AVX-512-BF16 / AMX), from /proc/cpuinfo."""
    return " ".join(radixserve_kernels.cpu.kind_flags()) or "none of " + " ".join(radixserve_kernels.cpu.KIND_FLAGS)


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
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one workload size field, e.g. --set conversation_concurrency=1 (repeatable)",
    )
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the default model's); 'none' for no GGUF")
    ap.add_argument("--hf-dir", default=None, help="the same model as a HF folder (default: the converted default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="KV cache size of every engine, in tokens")
    ap.add_argument(
        "--radix-args",
        default="",
        help="extra `radixserve serve` flags for radix and radix-nocache, e.g. '--page-size 1'",
    )
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/out/compare-<time>)")
    ap.add_argument("--plots", default=None, help="plot folder (default: the output folder)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--client",
        default="replay",
        choices=["replay", "guidellm", "both"],
        help="replay: ours (every workload); guidellm: multiturn, rag, nosharing through guidellm",
    )
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
    row |= {
        "best_hit_rate": best / max(total, 1),
        "rss_mb": server.rss_mb(),
        "peak_rss_mb": server.peak_rss_mb(),
        "load_start": load_start,
        "load_end": load1(),
    }
    return row, [dataclasses.asdict(r) for r in replay.results]


def served(
    engine: str,
    models: eng.Models,
    out: Path,
    what: str,
    rows: dict[str, Any],
    work: Callable[[eng.Server], None],
    parallel: int = 4,
) -> None:
    """Run work(server) on a fresh server, always stopped after; a failure (of the start too) becomes
    rows[engine]["error"], so one engine failing does not lose the others' figures."""
    print(f"[{time.strftime('%H:%M:%S')}] {what} ...", file=sys.stderr, flush=True)
    server = None
    try:
        server = eng.start(engine, models, out / "logs", parallel=parallel)
        work(server)
    except Exception as exc:
        rows[engine] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{what} failed: {exc}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()


@dataclasses.dataclass
class Run:
    """One invocation: the engines, models and sizes, and the document the figures go into."""

    engines: list[str]
    models: eng.Models
    size: workloads.Size
    tok: Any
    out: Path
    doc: dict[str, Any]
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)
    trace: list[list[fork.Call]] | None = None  # the DSL fork program as recorded on radixserve

    def replay(self, w: str) -> None:
        """Workload w through the replay client on every engine, a fresh server each."""
        rows = self.doc["workloads"].setdefault(w, {})
        for e in self.engines:
            if w == "fork" and self.trace is None and not e.startswith("radix"):
                rows[e] = {"error": "the fork workload is recorded on radixserve: include radix or radix-nocache"}
                continue
            served(e, self.models, self.out, f"{w} on {e}", rows, lambda server, e=e: self.replay_one(w, e, server))

    def replay_one(self, w: str, e: str, server: eng.Server) -> None:
        if w == "fork":
            if e.startswith("radix"):  # the DSL program itself, natively; the first run is recorded
                programs, wall, hits = fork.run_programs(server.url, self.size.fork_tasks)
                self.doc["dsl"][e] = {"wall_s": wall, **hits}
                self.trace = self.trace or programs
                eng.flush(server)
            sessions, conc = fork.sessions(self.trace or []), self.size.fork_concurrency
        else:
            sessions, conc = getattr(workloads, w)(self.tok, self.size)
        self.doc["workloads"][w][e], self.raw[f"{w}/{e}"] = run_one(server, sessions, conc, self.tok)

    def guidellm(self, w: str) -> None:
        """Workload w through guidellm on every engine, a fresh server each."""
        rows = self.doc["guidellm"].setdefault(w, {})
        for e in self.engines:
            served(
                e,
                self.models,
                self.out,
                f"{w} on {e} under guidellm",
                rows,
                lambda server, e=e: rows.__setitem__(e, self.guidellm_one(w, server)),
            )

    def guidellm_one(self, w: str, server: eng.Server) -> dict[str, Any]:
        load_start = load1()
        row = guidellm_run.run(w, self.size, server.url, self.models.hf_dir, self.out / "guidellm")
        return row | {
            "rss_mb": server.rss_mb(),
            "peak_rss_mb": server.peak_rss_mb(),
            "load_start": load_start,
            "load_end": load1(),
        }

    def micro(self) -> None:
        """The micro-benchmark on every engine, beside the memory bandwidth measured now."""
        before = measure_bandwidth(self.models.threads)
        res = self.doc["micro"] = {
            "bandwidth_gb_s": before,
            "threads": self.models.threads,
            "llama_slots": workloads.llama_slots(self.size),
            "engines": {},
        }
        for e in self.engines:
            if e != "radix-nocache":  # distinct prompts: the cache changes nothing here
                served(
                    e,
                    self.models,
                    self.out,
                    f"micro on {e}",
                    res["engines"],
                    lambda server, e=e: res["engines"].__setitem__(e, self.micro_one(e, server)),
                    parallel=res["llama_slots"],
                )
        # the ceilings use the better of the two measurements (before and after), the stricter yardstick
        res["bandwidth_samples_gb_s"] = [before, measure_bandwidth(self.models.threads)]
        res["bandwidth_gb_s"] = max(res["bandwidth_samples_gb_s"])
        for r in res["engines"].values():
            if "decode_bytes" in r:
                r["ceiling_tok_s"] = res["bandwidth_gb_s"] * 1e9 / r["decode_bytes"]

    def micro_one(self, e: str, server: eng.Server) -> dict[str, Any]:
        r = micro(server.url, self.tok, self.size)
        per_param = None if e.startswith("llama") else radix_bytes_per_param(server.url)
        if self.models.gguf is not None:  # per_param None: llama-server or radixserve on the blocks as stored
            read = gguf_decode_bytes(self.models.gguf, per_param)
        else:
            read = hf_decode_bytes(self.models.hf_dir, per_param or 2)
        return r | {"decode_bytes": read, "rss_mb": server.rss_mb(), "peak_rss_mb": server.peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen workloads on the chosen engines; returns 0 (an engine's failure is recorded, not raised)."""
    args = parse_args(argv)
    from radixserve.tokenizer import Tokenizer

    gguf, hf_dir = default_models()
    gguf = None if args.gguf == "none" else Path(args.gguf) if args.gguf else gguf
    hf_dir = Path(args.hf_dir) if args.hf_dir else hf_dir
    models = eng.Models(
        gguf if gguf and gguf.exists() else None,
        hf_dir,
        args.threads,
        args.kv_tokens,
        tuple(shlex.split(args.radix_args)),
    )
    size = workloads.resize(workloads.SIZES[args.size], args.set)
    out = Path(args.out) if args.out else eng.REPO / "benchmarks" / "out" / time.strftime("compare-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    engines = []
    for e in sorted(args.engines.split(","), key=lambda e: eng.ENGINES.index(e) if e in eng.ENGINES else 99):
        why = eng.unavailable_reason(e, models)
        if why:
            print(f"skipping {e}: {why}", file=sys.stderr)
        else:
            engines.append(e)
    doc: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "machine": machine(),
            "cpu_flags": cpu_flags(),
            "commit": commit(),
            "command": "python -m benchmarks.compare " + shlex.join(sys.argv[1:] if argv is None else argv),
            "load_start": load1(),
            "size": args.size,
            "engines": engines,
            "client": args.client,
            "size_detail": ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(size).items()),
            "models": {"gguf": str(models.gguf), "hf_dir": str(hf_dir)},
        },
        "workloads": {},
        "dsl": {},
        "guidellm": {},
    }
    run = Run(engines, models, size, Tokenizer.from_dir(hf_dir), out, doc)
    use_guidellm = args.client in ("guidellm", "both")
    if use_guidellm and not guidellm_run.available():
        print("skipping guidellm: not installed (run scripts/install_peers.sh)", file=sys.stderr)
        use_guidellm = False
    for w in args.workloads:
        if w == "micro":
            run.micro()
            continue
        if args.client in ("replay", "both"):
            run.replay(w)
        if use_guidellm and w in guidellm_run.WORKLOADS:
            run.guidellm(w)
    doc["meta"]["load_end"] = load1()
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results_raw.json").write_text(json.dumps(run.raw))
    md = report.markdown(doc)
    if not args.no_plots:
        made = plots.all_plots(doc, Path(args.plots) if args.plots else out)
        md += "\n" + "\n".join(f"![{p.stem}]({os.path.relpath(p, out)})" for p in made) + "\n"
    (out / "results.md").write_text(md)
    print(md)
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
