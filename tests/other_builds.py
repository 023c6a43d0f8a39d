"""Tests run again on another build of the CPU kernels (RADIXSERVE_CPU_MARCH: haswell for the AVX2 paths, x86-64 for
the plain C++ ones; RADIXSERVE_CPU_EMULATE_VNNI for the GGUF kernels' AVX-512 VNNI path on a CPU without it),
compiled here and run in a fresh process: one library per process registers the ops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def has_simde() -> bool:
    """Whether the C++ compiler finds SIMDe's AVX-512 header (Debian: libsimde-dev), which the emulated VNNI build
    takes its intrinsics from (radixserve_kernels/cpu/vnni_emulated.h)."""
    try:
        probe = subprocess.run(
            ["c++", "-fsyntax-only", "-x", "c++", "-"],
            input="#include <simde/x86/avx512.h>\n",
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no compiler
        return False
    return probe.returncode == 0


def failure_on_build(march: str, targets: list[str], select: str, emulate_vnni: bool = False) -> str | None:
    """pytest over `targets` (files or node ids) with `-k select` on the `march` build (with emulate_vnni: the GGUF
    kernels' VNNI path from SIMDe): None when it passes, else the end of its output."""
    env = {**os.environ, "RADIXSERVE_CPU_MARCH": march, "RADIXSERVE_CPU_EMULATE_VNNI": "1" if emulate_vnni else "0"}
    # Built first, on its own: a build that fails leaves ops() None, and the tests would then skip and pass.
    build = [sys.executable, "-c", "import sys, radixserve_kernels.cpu as k; sys.exit(k.ops() is None)"]
    built = subprocess.run(build, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if built.returncode != 0:
        return f"the {march} build failed: {built.stdout[-2000:]}{built.stderr[-3000:]}"
    # So does a file that could not read the precompiled header (radixserve_kernels/cpu/build.py: `-Winvalid-pch`),
    # which costs ~5 s a file without failing the build.
    if "precompiled.h.gch: not used" in built.stderr:
        return f"the {march} build did not use its precompiled header: {built.stderr[-3000:]}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *targets, "-k", select]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return None if done.returncode == 0 else done.stdout[-3000:] + done.stderr[-2000:]
