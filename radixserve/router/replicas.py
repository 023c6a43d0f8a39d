"""`radixserve serve --dp N`: N replicas of the server, each its own process with its own engine and KV cache, on
the ports after --port, and the cache-aware router in front on --port. One command for data parallelism on one
machine; across machines, start `radixserve serve` on each and `radixserve route --worker URL ...` in front.

The CPU's cores are split between the replicas (OMP_NUM_THREADS, unless set); with --device cuda and at least N
GPUs visible, replica i gets GPU i (CUDA_VISIBLE_DEVICES). The parent resolves the model once (so N children never
race to assemble or convert it), waits for every replica's /health, then runs the router in this process; when the
router stops, the replicas get SIGTERM (they drain their streams) and are waited for."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

log = logging.getLogger("radixserve.replicas")

# Options of `serve` that belong to the front (the router), not to the replicas.
FRONT_OPTIONS = {"--dp": 1, "--port": 1, "--host": 1, "--router-policy": 1, "--model": 1}
READY_TIMEOUT_S = 1800.0  # a first start may convert the model's weights


def replica_argv(argv: Sequence[str]) -> list[str]:
    """The `serve` command line of a replica: the user's options less the front's (each with its value)."""
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in FRONT_OPTIONS:
            skip = 0 if "=" in arg else FRONT_OPTIONS[name]
            continue
        out.append(arg)
    return out


def replica_env(i: int, dp: int, device: str, tp: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:  # a --tp replica splits its share again between its ranks
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dp))
    if device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch

        if torch.cuda.device_count() >= dp * tp:  # replica i's tp ranks: GPUs i*tp .. i*tp + tp - 1
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
    return env


def start_replicas(
    argv: Sequence[str], model: Path, dp: int, port: int, device: str, tp: int = 1
) -> list[tuple[str, subprocess.Popen]]:
    """Start dp `radixserve serve` processes on 127.0.0.1, ports port+1 .. port+dp; (url, process) each."""
    base = [sys.executable, "-m", "radixserve.cli", *replica_argv(argv), "--model", str(model), "--host", "127.0.0.1"]
    procs = []
    for i in range(dp):
        p = port + 1 + i
        cmd = [*base, "--port", str(p)]
        log.info("replica %d: %s", i, " ".join(cmd[2:]))
        procs.append((f"http://127.0.0.1:{p}", subprocess.Popen(cmd, env=replica_env(i, dp, device, tp))))
    return procs


def wait_ready(replicas: list[tuple[str, subprocess.Popen]], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every replica answers /health with 200; a replica that exits first is an error."""
    deadline = time.monotonic() + timeout_s
    pending = dict(replicas)
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"replica {url} exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    del pending[url]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not ready after {timeout_s:.0f} s: {', '.join(pending)}")
        if pending:
            time.sleep(0.5)


def stop_replicas(replicas: list[tuple[str, subprocess.Popen]], grace_s: float = 40.0) -> None:
    for _, proc in replicas:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, proc in replicas:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_replicas(args: argparse.Namespace, argv: Sequence[str], model: Path) -> int:
    """Serve with args.dp replicas behind the router on args.host:args.port; returns the exit code."""
    from radixserve.cli_args import build_parser
    from radixserve.router.launch import run_router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replicas = start_replicas(argv, model, args.dp, args.port, args.device, args.tp)
    try:
        wait_ready(replicas)
        route = ["route", "--host", args.host, "--port", str(args.port), "--policy", args.router_policy]
        for url, _ in replicas:
            route += ["--worker", url]
        print(f"ready: {args.dp} replicas behind the router on http://{args.host}:{args.port}", flush=True)
        run_router(build_parser().parse_args(route))
    finally:
        stop_replicas(replicas)
    return 0
