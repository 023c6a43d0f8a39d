"""The CPU kernels' build folder (kernels/cpu/__init__.py): a `lock` file left by a build that was killed part way
is removed by the next start, which would otherwise wait on it forever; one held by a live builder is not. A library
already built loads without cpp_extension; one that does not load (half-written) is built again."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import kernels.cpu as cpu_kernels


class RecordingExtension:
    """Stands in for torch.utils.cpp_extension: records whether its `lock` file was there when load ran."""

    def __init__(self, where: Path) -> None:
        self.where, self.saw_lock = where, []

    def load(self, **kwargs: object) -> None:
        assert kwargs["build_directory"] == str(self.where)
        self.saw_lock.append((self.where / "lock").exists())


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")
    ext = RecordingExtension(tmp_path)
    with cpu_kernels._build_lock(tmp_path):
        cpu_kernels._build_and_load(ext, tmp_path)
    assert ext.saw_lock == [False]


def test_a_live_builder_keeps_its_lock(tmp_path: Path) -> None:
    ext = RecordingExtension(tmp_path)
    with open(tmp_path / "build.flock", "w") as live:  # another builder, still running
        fcntl.flock(live, fcntl.LOCK_EX)
        (tmp_path / "lock").write_text("")

        def start() -> None:
            with cpu_kernels._build_lock(tmp_path):
                cpu_kernels._build_and_load(ext, tmp_path)

        waiting = threading.Thread(target=start)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and (tmp_path / "lock").exists() and ext.saw_lock == []
        (tmp_path / "lock").unlink()  # the live builder finishes: cpp_extension deletes its lock, then lets go
    waiting.join(timeout=10)
    assert ext.saw_lock == [False]


def test_a_built_library_loads_without_cpp_extension() -> None:
    assert cpu_kernels.ops() is not None  # built (or already there) in this folder
    code = (
        "import sys, kernels.cpu as k; assert k.ops() is not None; "
        "print('torch.utils.cpp_extension' in sys.modules, hasattr(k.ops(), 'gguf_linear'))"
    )
    root = Path(cpu_kernels.__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]


def test_a_library_that_does_not_load_is_built_again(tmp_path: Path) -> None:
    (tmp_path / f"radixserve_cpu_{tmp_path.name}.so").write_bytes(b"\x7fELF half written")
    assert not cpu_kernels._load_built(tmp_path)
    assert not cpu_kernels._load_built(tmp_path / "empty")  # nothing built there yet


def test_the_heavy_torch_headers_stay_out_of_the_kernels_files() -> None:
    """ATen/ATen.h and torch/library.h cost ~16 s of compile per file on 2 cores (kernels/cpu/ops.h): only the files
    that register ops include torch/library.h, and none ATen/ATen.h (nor ATen/ops/empty.h and the like: ATen/Context.h),
    so a machine's first start compiles the kernels in about half the time."""
    registering = {"library.cpp", "decoder_stack.cpp"}
    for src in [*cpu_kernels.SOURCES, *cpu_kernels.HEADERS]:
        includes = {line.split()[1] for line in src.read_text().splitlines() if line.startswith("#include <")}
        assert "<ATen/ATen.h>" not in includes, src.name
        assert not any(i.startswith("<ATen/ops/") and not i.endswith("_ops.h>") for i in includes), src.name
        assert ("<torch/library.h>" in includes) == (src.name in registering), src.name
