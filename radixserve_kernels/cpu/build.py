"""Compile this folder's C++ into one shared library on the machine's cores: `compile_library`.

Why our own build rather than torch.utils.cpp_extension.load: every kernel file parses torch's ATen/core/Tensor.h,
~5 s of each file's compile on 2 cores, most of a first start's build. Here GCC parses it once into a precompiled
header (`PRECOMPILED`, built alongside library.cpp, the one file that includes heavier headers and so does not use
it) that the other files read in a fraction of a second. GCC uses a precompiled header only when the flags and
macros match the compile's exactly and otherwise parses the header as usual, so a mismatch costs time, never
correctness; `-Winvalid-pch` makes it say so, and the build logs that (the tests' other-ISA builds fail on it,
tests/other_builds.py). The objects are the same bytes either way. Only the library is kept (the precompiled header
is ~160 MB).
"""

from __future__ import annotations

import logging
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
# The torch headers every kernel file includes, parsed once (why: the module docstring).
PRECOMPILED = ("ATen/core/Tensor.h", "ATen/Parallel.h")
# Includes torch/library.h and torch/custom_class.h, which the header does not hold: it compiles while the header is
# made, rather than after it.
WITHOUT_PRECOMPILED = {"library.cpp"}
log = logging.getLogger("radixserve.kernels")


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def flags(cflags: list[str]) -> list[str]:
    """Every compile's flags: torch's include folders and C++ ABI, position-independent code, then `cflags`."""
    include = Path(torch.__file__).parent / "include"
    return [
        f"-isystem{include}",
        f"-isystem{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-fPIC",
        "-std=c++20",
        "-Winvalid-pch",
        *cflags,
    ]


def compile_command(src: Path, where: Path, cflags: list[str]) -> list[str]:
    """The command that compiles `src` into where/<stem>.o, reading the precompiled header unless it is library.cpp."""
    pch = [] if src.name in WITHOUT_PRECOMPILED else ["-include", str(where / "precompiled.h")]
    return [compiler(), *flags(cflags), *pch, "-c", str(src), "-o", str(where / f"{src.stem}.o")]


def compile_library(where: Path, name: str, cflags: list[str], ldflags: list[str]) -> Path:
    """Compile SOURCES into where/<name>.so (written whole, then renamed into place) and return its path."""
    header = where / "precompiled.h"
    header.write_text("".join(f"#include <{h}>\n" for h in PRECOMPILED))
    objects = [where / f"{src.stem}.o" for src in SOURCES]
    first = [s for s in SOURCES if s.name in WITHOUT_PRECOMPILED]
    then = [s for s in SOURCES if s.name not in WITHOUT_PRECOMPILED]
    try:
        with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
            make_pch = [compiler(), *flags(cflags), "-x", "c++-header", str(header), "-o", f"{header}.gch"]
            pch = pool.submit(_run, header.name, make_pch)
            started = [pool.submit(_run, s.name, compile_command(s, where, cflags)) for s in first]
            pch.result()
            started += [pool.submit(_run, s.name, compile_command(s, where, cflags)) for s in then]
            for job in started:
                job.result()
        library, partial = where / f"{name}.so", where / f"{name}.so.partial"
        lib = Path(torch.__file__).parent / "lib"
        link = [compiler(), *map(str, objects), "-shared", *ldflags, f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
        _run("link", [*link, "-o", str(partial)])
        partial.replace(library)
        return library
    finally:
        for leftover in [*objects, where / "precompiled.h.gch"]:
            leftover.unlink(missing_ok=True)


def _run(label: str, command: list[str]) -> None:
    """Run one compile or the link; raise with the compiler's message when it fails, log what it warns."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the CPU kernels: {label} failed:\n{done.stderr[-4000:]}")
    if done.stderr.strip():
        log.warning("compiling the CPU kernels, %s: %s", label, done.stderr.strip()[-2000:])
