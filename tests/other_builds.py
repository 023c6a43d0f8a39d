"""Tests run again on another build of the CPU kernels (RADIXSERVE_CPU_MARCH: haswell for the AVX2 paths, x86-64 for
the plain C++ ones), compiled here and run in a fresh process: one library per process registers the ops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def failure_on_build(march: str, targets: list[str], select: str) -> str | None:
    """pytest over `targets` (files or node ids) with `-k select` on the `march` build: None when it passes, else
    the end of its output."""
    env = {**os.environ, "RADIXSERVE_CPU_MARCH": march}
    # Built first, on its own: a build that fails leaves ops() None, and the tests would then skip and pass.
    build = [sys.executable, "-c", "import sys, kernels.cpu as k; sys.exit(k.ops() is None)"]
    built = subprocess.run(build, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if built.returncode != 0:
        return f"the {march} build failed: {built.stdout[-2000:]}{built.stderr[-3000:]}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *targets, "-k", select]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return None if done.returncode == 0 else done.stdout[-3000:] + done.stderr[-2000:]
