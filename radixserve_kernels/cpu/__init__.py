"""Our CPU kernels: C++ with AVX-512 / AVX2 intrinsics, compiled on first use for this machine's CPU and cached.

Why compiled here: the fast paths are instruction-set specific (AVX-512 VNNI for int8 dot products, AVX2 FMA where
there is none), so each file is built with `-march=native` and picks its path at compile time. The build directory
is keyed by the sources, torch's version and the CPU's flags, so a build made on another CPU (a shared home, a CI
cache) is never loaded. The ops register under `torch.ops.radixserve`; `ops()` returns None where nothing can be
built (no C++ compiler; a non-x86 CPU is fine: it takes the scalar path) or when RADIXSERVE_CPU_KERNELS=0,
and every caller then runs its pure-torch path. RADIXSERVE_CPU_MARCH (default `native`) builds for another
instruction set, e.g. `haswell` for the AVX2 path or `x86-64` for the plain one: how the tests run every path on
one machine. RADIXSERVE_CPU_EMULATE_VNNI=1 (tests only, with `haswell`) builds the GGUF kernels' AVX-512 VNNI path
with its intrinsics from SIMDe, a software emulation (gguf_blocks.h), so that a CPU without AVX-512 checks it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from radixserve_kernels.cpu.build import HEADERS, SOURCES, compile_library, flags

log = logging.getLogger("radixserve.kernels")


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel (Linux /proc/cpuinfo) sees them; the platform name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# The flags that decide radixserve's CPU kind and these kernels' paths: what the benchmarks print with their figures.
KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def kind_flags() -> list[str]:
    """Those of KIND_FLAGS this CPU has."""
    have = set(cpu_flags().split())
    return [f for f in KIND_FLAGS if f in have]


def march() -> str:
    return os.environ.get("RADIXSERVE_CPU_MARCH", "native")


def emulate_vnni() -> bool:
    return os.environ.get("RADIXSERVE_CPU_EMULATE_VNNI", "0") == "1"


def build_dir() -> Path:
    """Where the compiled library of these sources lives on this CPU: $RADIXSERVE_CACHE (else ~/.cache/radixserve)
    /cpu-kernels/<hash of sources, torch, CPU flags and build options>."""
    digest = hashlib.sha256()
    for src in [*SOURCES, *HEADERS]:
        digest.update(src.name.encode() + src.read_bytes())
    digest.update(f"{torch.__version__}|{cpu_flags()}|{' '.join(flags(cflags()))}".encode())
    root = Path(os.environ.get("RADIXSERVE_CACHE") or Path.home() / ".cache" / "radixserve")
    return root / "cpu-kernels" / digest.hexdigest()[:16]


@functools.cache
def ops() -> Any | None:
    """`torch.ops.radixserve` with our CPU ops loaded, or None (see the module docstring) after one warning."""
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        return None
    where = build_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with _build_lock(where):
            if not _load_built(where):
                _build_and_load(where)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the pure-torch paths
        log.warning("radixserve CPU kernels unavailable (%s: %s); using the pure-torch paths", type(exc).__name__, exc)
        return None
    return torch.ops.radixserve


@contextlib.contextmanager
def _build_lock(where: Path) -> Iterator[None]:
    """Hold the build folder for this process, so that two starts on one machine build it once: the second waits,
    then loads what the first built. The flock dies with its process, so a builder killed part way blocks nobody."""
    with open(where / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _load_built(where: Path) -> bool:
    """Load the library already built in `where` into torch.ops.radixserve; False when there is none (or it does not
    load). The folder is keyed by the sources, so a library there is theirs."""
    library = where / f"{_library_name(where)}.so"
    if not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:  # a library left half-written by a killed link: build it again
        log.warning("rebuilding the CPU kernels: %s did not load (%s)", library, exc)
        return False
    return True


def _library_name(where: Path) -> str:
    return f"radixserve_cpu_{where.name}"


def cflags() -> list[str]:
    """The compiler's options for this build (RADIXSERVE_CPU_MARCH, RADIXSERVE_CPU_EMULATE_VNNI)."""
    # -fopenmp: at::parallel_for is inlined OpenMP; the library links libgomp.so.1 by soname, which is the copy torch
    # already loaded, so our ops share torch's thread pool and its thread count.
    # -ffp-contract=off: no multiply-add fused behind our back, so the fused elementwise ops round exactly where the
    # torch ops they replace do (explicit FMA intrinsics are unaffected).
    options = ["-O3", f"-march={march()}", "-fopenmp", "-ffp-contract=off"]
    if emulate_vnni():  # SIMDe's 512-bit types on a 256-bit build: GCC notes their ABI, which nothing outside uses
        options += ["-DRADIXSERVE_GGUF_EMULATE_VNNI", "-Wno-psabi"]
    return options


def _build_and_load(where: Path) -> None:
    """Build the library into `where` (radixserve_kernels/cpu/build.py) and load it into torch.ops.radixserve."""
    library = compile_library(where, _library_name(where), cflags(), ldflags=["-fopenmp"])
    torch.ops.load_library(str(library))
