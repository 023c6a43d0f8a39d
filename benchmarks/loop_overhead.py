"""The engine loop's own cost per decode step, measured on a CPU with the null model (radixserve/model/null.py).

    python -m benchmarks.loop_overhead [--batches 64,256] [--prompt-lens 64,2048] [--trees before=PATH,after=.]
                                       [--profile DIR]

Each measurement runs in a child process on a tree (a checkout; `.` is this one), alternating trees per setting so
that a noisy machine hits both alike. A child starts an Engine on a tiny model folder with `null_model=True`
(every step returns fixed logits of the model's shape at once: no layer runs), overlap scheduling on (the loop
thread schedules and processes, the step worker executes), submits `batch` requests of a 64-token prompt (or of
each `--prompt-lens`: the context every step's page table covers) and lets them reach steady decode; then, over a
window, it reads each engine thread's CPU time (psutil) and counts the steps. Reported per decode step: the loop thread's, the step worker's and the output stage's CPU milliseconds,
and the wall time. The vocabulary is the tiny tokenizer's (512): logits-sized tensor work is device work on a GPU,
and kept small here so that what is measured is the host path.

Settings: `plain` (one generate call, nothing streamed), `stream` (every request streamed to its own consumer),
`mix` (a quarter of the requests regex-constrained, a quarter n = 2 pairs) and `spec` (n-gram speculation on,
which runs with overlap off: every phase on the loop thread).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

NEW_TOKENS = 4096
THREADS = {"loop": "radixserve-loop", "worker": "radixserve-step", "output": "radixserve-output"}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of each engine thread, by THREADS' keys."""
    import psutil

    by_id = {t.native_id: t.name for t in threading.enumerate()}
    out = dict.fromkeys(THREADS, 0.0)
    for t in psutil.Process().threads():
        name = by_id.get(t.id, "")
        for key, prefix in THREADS.items():
            if name.startswith(prefix):
                out[key] += t.user_time + t.system_time
    return out


def _requests(setting: str, batch: int, prompt_len: int) -> list[tuple[list[int], dict[str, Any]]]:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reqs = []
    for i in range(batch):
        ids = [3 + (7 * i + 13 * j) % 500 for j in range(prompt_len)]
        p = dict(params)
        if setting == "mix" and i % 4 == 1:
            p["regex"] = "(a|b|c)+"
        if setting == "mix" and i % 4 == 2 and i + 1 < batch:
            p["n"] = 2
        reqs.append((ids, p))
    if setting == "mix":  # an n = 2 request counts twice: keep the batch at `batch` sequences
        reqs = [r for i, r in enumerate(reqs) if not (i % 4 == 3 and reqs[i - 1][1].get("n") == 2)]
    return reqs


def _submit(eng: Any, setting: str, reqs: list[tuple[list[int], dict[str, Any]]]) -> threading.Thread:
    """Start the requests from a thread of their own (a client); returns it."""

    async def consume(ids: list[int], params: dict[str, Any]) -> None:
        async for _ in eng.async_generate(input_ids=ids, sampling_params=params, stream=True):
            pass

    async def stream_all() -> None:
        await asyncio.gather(*(consume(ids, p) for ids, p in reqs))

    async def plain_all() -> None:
        await asyncio.gather(*(eng.async_generate(input_ids=ids, sampling_params=p) for ids, p in reqs))

    def client() -> None:
        try:
            asyncio.run(stream_all() if setting == "stream" else plain_all())
        except Exception:  # noqa: BLE001 - the engine's shutdown ends the requests; nothing to report
            pass

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    return thread


def measure(
    model: Path, setting: str, batch: int, window: float, profile: Path | None, prompt_len: int = 64
) -> dict[str, Any]:
    """One setting in this process (a child): CPU ms per decode step of each engine thread, and wall ms."""
    from radixserve import Engine

    spec = setting == "spec"
    eng = Engine(
        model=model,
        null_model=True,
        dtype="float32",
        max_running_requests=batch,
        max_total_tokens=batch * (prompt_len + NEW_TOKENS + 64),
        overlap_schedule=not spec,
        speculative="ngram" if spec else "off",
    )
    try:
        _submit(eng, setting, _requests(setting, batch, prompt_len))
        # Steady decode: nothing waits and every request has a few tokens out (its prefill is done).
        while (m := eng.metrics())["num_waiting"] or m["generation_tokens_total"] < 8 * batch:
            time.sleep(0.05)
        steps = _Counter(eng)
        cpu0, t0, n0 = _thread_cpu(), time.perf_counter(), steps.calls
        time.sleep(window)
        cpu1, wall, n = _thread_cpu(), time.perf_counter() - t0, steps.calls - n0
        if profile is not None:
            from benchmarks.gpu.bench_engine import profile_host

            profile.write_text(profile_host(eng, window))
        if eng.metrics()["num_running"] < batch:
            raise RuntimeError("requests ended inside the window: raise NEW_TOKENS")
    finally:
        eng.shutdown()
    row = {"setting": setting, "batch": batch, "prompt": prompt_len, "steps": n, "wall_ms": wall * 1e3 / max(n, 1)}
    row |= {f"{k}_ms": (cpu1[k] - cpu0[k]) * 1e3 / max(n, 1) for k in THREADS}
    return row


class _Counter:
    """Counts the scheduler's processed steps from now on."""

    def __init__(self, eng: Any) -> None:
        self.calls = 0
        inner = eng.scheduler.process

        def process(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        eng.scheduler.process = process


def _child(tree: str, args: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import json,sys; from benchmarks.loop_overhead import measure_json; print(measure_json(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], env=env, cwd=tree, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"child on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_json(arg: str) -> str:
    a = json.loads(arg)
    profile = Path(a["profile"]) if a.get("profile") else None
    return json.dumps(measure(Path(a["model"]), a["setting"], a["batch"], a["window"], profile, a["prompt_len"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--settings", default="plain,stream,mix,spec")
    ap.add_argument(
        "--prompt-lens", default="64", help="prompt tokens per request, a list: the context each step reads"
    )
    ap.add_argument("--trees", default="after=.", help="label=path,...: checkouts to compare (alternated)")
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--profile", type=Path, default=None, help="write a cProfile of batch 64 plain per tree here")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/radixserve-loop"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tiny_checkpoint
    from tiny_tokenizer import build_tokenizer

    model = args.workdir / "tiny-qwen2"
    if not (model / "tokenizer.json").exists():
        make_tiny_checkpoint(model, "qwen2", max_position_embeddings=8192)
        build_tokenizer(model)
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    rows = []
    lens, batches, settings = (a.split(",") for a in (args.prompt_lens, args.batches, args.settings))
    for prompt_len, batch, setting in itertools.product(map(int, lens), map(int, batches), settings):
        for label, tree in trees.items():
            job = {"model": str(model), "setting": setting, "batch": batch, "window": args.window}
            job["prompt_len"] = prompt_len
            if args.profile is not None and batch == 64 and setting == "plain" and prompt_len == 64:
                args.profile.mkdir(parents=True, exist_ok=True)
                job["profile"] = str((args.profile / f"loop_profile_{label}.txt").resolve())
            row = {"tree": label, **_child(str(Path(tree).resolve()), job)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    import torch

    import radixserve_kernels.cpu as cpu_kernels

    print(
        f"\nmachine: CPU {cpu_kernels.cpu_model()} ({' '.join(cpu_kernels.kind_flags())}), torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {time.strftime('%Y-%m-%d %H:%M')}, trees {args.trees}"
    )
    cols = ["tree", "setting", "batch", "prompt", "steps", "loop_ms", "worker_ms", "output_ms", "wall_ms"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
