"""Every GPU check and benchmark of issue 8 in one process; results as JSON and Markdown under --out.

On the GPU machine (see benchmarks/gpu/README.md): `bash benchmarks/gpu/run.sh [--sections ...]`.
Here, without a GPU, `--smoke` runs the same code paths on a tiny model on the CPU (the torch backend; the
flashinfer, CUDA-graph and profiler parts are reported as skipped) to catch mistakes before device time is spent.

    python -m benchmarks.gpu.run_all --out DIR [--sections env,ceilings,attention,graphs,greedy,kvpages,model,idle,prefix]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The triton backend runs interpreted without a GPU; set before radixserve_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.gpu import bench_engine, bench_kernels, bench_model, check_correctness  # noqa: E402
from benchmarks.gpu.common import (  # noqa: E402
    LLAMA3_8B,
    TINY,
    markdown_table,
    measure_ceilings,
    write_random_checkpoint,
)

SECTIONS = ["env", "ceilings", "attention", "kernels", "graphs", "greedy", "kvpages", "model", "idle", "prefix"]
NEEDS_CUDA = {
    "attention": "flashinfer/triton kernels",
    "kernels": "flashinfer/triton kernels",
    "graphs": "CUDA graphs",
    "idle": "a CUDA profiler trace",
}


class Report:
    """Accumulates rows per section; rewrites results.json and results.md after every section."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.sections: dict[str, dict[str, Any]] = {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, status: str, rows: list[dict[str, Any]], seconds: float, note: str = "") -> None:
        self.sections[name] = {"status": status, "seconds": seconds, "rows": rows, "note": note}
        (self.out / "results.json").write_text(json.dumps(self.sections, indent=1, default=str))
        md = []
        for sec, data in self.sections.items():
            md.append(f"## {sec}: {data['status']} ({data['seconds']:.0f} s)\n")
            if data["note"]:
                md.append(data["note"] + "\n")
            if data["rows"]:
                cols = list(dict.fromkeys(k for r in data["rows"] for k in r))
                md.append(markdown_table(data["rows"], cols) + "\n")
        (self.out / "results.md").write_text("\n".join(md))
        print(f"\n## {name}: {status} ({seconds:.0f} s) {note}", flush=True)
        if rows:
            print(markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r))), flush=True)


def environment(device: torch.device) -> list[dict[str, Any]]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}",
        }
    for pkg in ("flashinfer", "triton"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception as e:  # noqa: BLE001 - report, do not fail
            info[pkg] = f"unavailable: {e!r}"[:120]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        )
        info["nvidia-smi"] = smi.stdout.strip()
    return [info]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/out")))
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--backends", default=None, help="default: flashinfer,triton on a GPU; none besides torch on CPU")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (what a CPU can run)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/radixserve-gpu"), help="random checkpoints go here")
    ap.add_argument("--groups", type=int, default=8, help="shared-prefix workload: system prompts")
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--answer-len", type=int, default=256)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no GPU here: nothing to measure (use --smoke to exercise the scripts on a tiny model)")
    smoke = args.smoke
    backends = [b for b in (args.backends or ("flashinfer,triton" if device.type == "cuda" else "")).split(",") if b]
    model_cfg = TINY if smoke else LLAMA3_8B
    report = Report(args.out)
    ceilings: dict[str, float] = {}
    model_dir: Path | None = None

    def engine_model() -> Path:
        nonlocal model_dir
        if model_dir is None:
            model_dir = write_random_checkpoint(args.workdir / ("tiny" if smoke else "llama3-8b"), model_cfg, device)
        return model_dir

    def ensure_ceilings() -> dict[str, float]:
        if not ceilings:
            ceilings.update(
                measure_ceilings(device, copy_bytes=(64 << 20) if smoke else (2 << 30), matmul_n=512 if smoke else 8192)
            )
        return ceilings

    runs: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "env": lambda: environment(device),
        "ceilings": lambda: [{k: v for k, v in ensure_ceilings().items()}],
        "attention": lambda: check_correctness.attention_parity(device, backends),
        "kernels": lambda: bench_kernels.attention_kernels(device, ensure_ceilings()),
        "graphs": lambda: check_correctness.graph_parity(device),
        "greedy": lambda: check_correctness.greedy_parity(device, args.workdir, backends, smoke),
        "kvpages": lambda: check_correctness.kv_page_parity(device, args.workdir, backends, smoke),
        "model": lambda: bench_model.model_benchmarks(
            device,
            model_cfg,
            ensure_ceilings(),
            ["torch"] if smoke else backends,
            batch_sizes=(1, 4) if smoke else (1, 32, 128),
            context=64 if smoke else 2048,
            prefill_tokens=256 if smoke else 8192,
            use_graphs=not smoke,
        ),
        "idle": lambda: [
            bench_engine.decode_idle(
                device,
                engine_model(),
                overlap,
                num_requests=64,
                prompt_len=256,
                new_tokens=1024,
                profile_s=2.0,
                backend="flashinfer",
                profile_out=args.out / f"idle_host_profile_overlap_{int(overlap)}.txt",
            )
            for overlap in (False, True)
        ],
        "prefix": lambda: [
            bench_engine.shared_prefix(
                device,
                engine_model(),
                cache,
                groups=2 if smoke else args.groups,
                per_group=4 if smoke else args.per_group,
                system_len=64 if smoke else 2048,
                question_len=8 if smoke else 128,
                answer_len=8 if smoke else args.answer_len,
                backend="torch" if smoke else "flashinfer",
                max_running=8 if smoke else 128,
            )
            for cache in (False, True)
        ],
    }
    for name in args.sections.split(","):
        if name not in runs:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        if device.type != "cuda" and name in NEEDS_CUDA:
            report.add(name, "skipped", [], 0.0, f"needs CUDA ({NEEDS_CUDA[name]})")
            continue
        if name == "graphs" and "flashinfer" not in backends:
            report.add(name, "skipped", [], 0.0, "CUDA graphs run on the flashinfer backend only")
            continue
        t0 = time.perf_counter()
        try:
            rows = runs[name]()
            failed = [r for r in rows if r.get("ok") is False]
            status = f"FAILED {len(failed)} of {len(rows)}" if failed else "ok"
            report.add(name, status, rows, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others' results
            report.add(name, "ERROR", [], time.perf_counter() - t0, f"{e!r}\n```\n{traceback.format_exc()[-3000:]}```")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n# summary")
    for name, data in report.sections.items():
        first_line = data["note"].splitlines()[0][:90] if data["note"] else ""
        print(f"{name:10s} {data['status']:14s} {data['seconds']:7.0f} s  {first_line}")


if __name__ == "__main__":
    main()
