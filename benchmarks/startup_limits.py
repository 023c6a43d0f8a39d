"""What bounds a later start of `radixserve serve` (issue 38: "later starts as fast as llama-server's"; RESULTS.md,
issue 38 session 53). Four measurements, each in fresh processes, runs alternated:

- gil: whether the tokenizers library's parse of tokenizer.json lets other threads run (a thread counting in a loop
  beside it, against the same thread while the main thread sleeps as long).
- preload: libtorch_cpu.so loaded on a thread (ctypes lets the GIL go during dlopen) while the main thread parses
  the tokenizer, then `import torch`; against the same work done in turn.
- serve: the time to the first 200 from /health (benchmarks.startup's clock) of the default start, with
  RADIXSERVE_HUGE_PAGES=0 (no huge-page move beside torch's import), with libtorch_cpu.so preloaded on a thread
  before the CLI runs, and with the tokenizer parsed before torch and handed to the Engine (by replacing
  Tokenizer.from_dir in that process: a measurement, not a way the engine starts).
- split: a child process that imports torch and builds Engine(), beside a parent without torch that imports the HTTP
  stack and parses the tokenizer: the floor of a server/engine process split as the engine stands.

    .venv/bin/python -m benchmarks.startup_limits [--runs 6] [--only gil preload serve split]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks.startup import ROOT, start_once

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(ROOT)}
TORCH_CPU = """
import importlib.util, os
TORCH_CPU = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib", "libtorch_cpu.so")
"""

GIL = """
import threading, time
from radixserve.model.resolve import resolve_model
from tokenizers import Tokenizer
path = str(resolve_model(None) / "tokenizer.json")
count, done = 0, False
def spin():
    global count
    while not done: count += 1
thread = threading.Thread(target=spin); thread.start(); time.sleep(0.1)
c0, t0 = count, time.perf_counter(); Tokenizer.from_file(path); parse = time.perf_counter() - t0
c1 = count; time.sleep(parse); c2 = count; done = True; thread.join()
print(f"{parse:.3f} {(c1 - c0) / max(c2 - c1, 1):.4f}")
"""

PRELOAD = (
    TORCH_CPU
    + """
import ctypes, sys, threading, time
t0 = time.perf_counter()
from radixserve.model.resolve import resolve_model
from tokenizers import Tokenizer
path = str(resolve_model(None) / "tokenizer.json")
if sys.argv[1] == "thread":
    loader = threading.Thread(target=ctypes.CDLL, args=(TORCH_CPU,)); loader.start()
Tokenizer.from_file(path)
if sys.argv[1] == "thread":
    loader.join()
import torch
print(f"{time.perf_counter() - t0:.3f}")
"""
)

# Run before the CLI in the serve variants' process (then `radixserve serve` as `python -m radixserve.cli` runs it).
SERVE_PREAMBLE = (
    TORCH_CPU
    + """
import ctypes, runpy, sys, threading
if "preload" in sys.argv[1]:
    threading.Thread(target=ctypes.CDLL, args=(TORCH_CPU,), daemon=True).start()
if "tokenizer" in sys.argv[1]:
    from radixserve.model.resolve import resolve_model
    from radixserve.tokenizer import Tokenizer
    parsed = Tokenizer.from_dir(resolve_model(None))
    Tokenizer.from_dir = classmethod(lambda cls, path: parsed)
sys.argv = ["radixserve", *sys.argv[2:]]
runpy.run_module("radixserve.cli", run_name="__main__", alter_sys=True)
"""
)

SPLIT = """
import subprocess, sys, time
t0 = time.perf_counter()
engine = subprocess.Popen(
    [sys.executable, "-c", "import radixserve.engine\\nradixserve.engine.Engine()\\nprint('ready', flush=True)\\n"
     "import sys; sys.stdin.read()"], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
import jinja2, msgspec, starlette.applications, uvicorn
from radixserve.model.resolve import resolve_model
from radixserve.tokenizer import Tokenizer
Tokenizer.from_dir(resolve_model(None))
front = time.perf_counter() - t0
assert engine.stdout.readline().startswith("ready")
both = time.perf_counter() - t0
engine.stdin.close(); engine.wait()
print(f"{front:.3f} {both:.3f}")
"""


def python(code: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, *args], env=ENV, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout.split()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def gil(runs: int) -> None:
    rows = [python(GIL) for _ in range(runs)]
    rate = statistics.median(float(r[1]) for r in rows)
    print(f"gil: parse {spread([float(r[0]) for r in rows])}; the counting thread ran at {rate:.1%} of its rate")


def preload(runs: int) -> None:
    times: dict[str, list[float]] = {"in turn": [], "thread": []}
    for _ in range(runs):
        for mode in times:
            times[mode].append(float(python(PRELOAD, mode)[0]))
    print("preload: tokenizer parse + import torch: " + "; ".join(f"{m} {spread(t)}" for m, t in times.items()))


def serve(runs: int, port: int) -> None:
    def cmd(mode: str) -> list[str]:
        return [sys.executable, "-c", SERVE_PREAMBLE, mode, "serve", "--port", str(port)]

    variants = {
        "default": (cmd("plain"), ENV),
        "RADIXSERVE_HUGE_PAGES=0": (cmd("plain"), ENV | {"RADIXSERVE_HUGE_PAGES": "0"}),
        "libtorch_cpu.so preloaded": (cmd("preload"), ENV),
        "tokenizer parsed first": (cmd("tokenizer"), ENV),
        "both": (cmd("preload+tokenizer"), ENV),
    }
    start_once(variants["default"][0], port, ENV, 0, 900)  # untimed: the bytecode and the page cache
    ready: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, (argv, env) in variants.items():
            ready[name].append(start_once(argv, port, env, 0, 300)[0])
    for name, times in ready.items():
        print(f"serve, {name}: ready in {spread(times)}")


def split(runs: int) -> None:
    rows = [python(SPLIT) for _ in range(runs)]
    print(
        f"split: front process done in {spread([float(r[0]) for r in rows])}, "
        f"both ready in {spread([float(r[1]) for r in rows])}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--only", nargs="+", default=["gil", "preload", "serve", "split"])
    ap.add_argument("--port", type=int, default=39200)
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, load {os.getloadavg()[0]:.1f}")
    for part in a.only:
        if part == "serve":
            serve(a.runs, a.port)
        else:
            {"gil": gil, "preload": preload, "split": split}[part](a.runs)


if __name__ == "__main__":
    main()
