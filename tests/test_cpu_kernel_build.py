"""The CPU kernels' build (radixserve_kernels/cpu/__init__.py, radixserve_kernels/cpu/build.py): two starts build a
folder once, a library already built loads without a compile, one that does not load (half-written) is built again, and
the kernel files keep torch's heavy headers out."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import radixserve_kernels.cpu as cpu_kernels
from radixserve_kernels.cpu import build


def test_a_second_start_waits_for_the_first_builder(tmp_path: Path) -> None:
    entered = []
    with open(tmp_path / "build.flock", "w") as live:  # another start, still building
        fcntl.flock(live, fcntl.LOCK_EX)

        def start() -> None:
            with cpu_kernels._build_lock(tmp_path):
                entered.append(time.monotonic())

        waiting = threading.Thread(target=start)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and entered == []
    waiting.join(timeout=10)  # the builder let go (or died: its flock goes with it)
    assert len(entered) == 1


def test_a_built_library_loads_without_a_compile() -> None:
    assert cpu_kernels.ops() is not None  # built (or already there) in this folder
    code = "import radixserve_kernels.cpu as k; k.compile_library = None; print(hasattr(k.ops(), 'gguf_linear'))"
    root = Path(cpu_kernels.__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["True"], done.stderr[-2000:]


def test_a_library_that_does_not_load_is_built_again(tmp_path: Path) -> None:
    (tmp_path / f"radixserve_cpu_{tmp_path.name}.so").write_bytes(b"\x7fELF half written")
    assert not cpu_kernels._load_built(tmp_path)
    assert not cpu_kernels._load_built(tmp_path / "empty")  # nothing built there yet


def test_the_heavy_torch_headers_stay_out_of_the_kernels_files() -> None:
    """ATen/ATen.h and torch/library.h cost ~16 s of compile per file on 2 cores (radixserve_kernels/cpu/ops.h): only
    the file that registers the ops and the class includes torch/library.h and torch/custom_class.h (and compiles
    without the precompiled header, while it is made), and none ATen/ATen.h (nor ATen/ops/empty.h and the like:
    ATen/Context.h), so a machine's first start compiles the kernels in about a third of the time."""
    assert build.WITHOUT_PRECOMPILED == {"library.cpp"}
    for src in [*cpu_kernels.SOURCES, *cpu_kernels.HEADERS]:
        includes = {line.split()[1] for line in src.read_text().splitlines() if line.startswith("#include <")}
        assert "<ATen/ATen.h>" not in includes, src.name
        assert not any(i.startswith("<ATen/ops/") and not i.endswith("_ops.h>") for i in includes), src.name
        for heavy in ("<torch/library.h>", "<torch/custom_class.h>"):
            assert (heavy in includes) == (src.name in build.WITHOUT_PRECOMPILED), (src.name, heavy)
