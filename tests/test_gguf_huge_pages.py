"""Moving a GGUF's mapped blocks onto huge pages (radixserve/gguf/huge_pages.py): the runs it picks, the bytes and
addresses it keeps while readers read them, the default model's tokens with and without it, the ranges moved against
the blocks the model reads in place, and when `radixserve serve` starts the move early."""

from __future__ import annotations

import mmap
import platform
import sys
import threading
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_checks import engine_left_at_rest
from radixserve.gguf import huge_pages
from radixserve.gguf.huge_pages import HUGE_PAGE, HugePageMover, page_runs
from radixserve.gguf.tensor_table import read_tensor_table
from radixserve.model.gguf_linear import GGUFLinear
from radixserve.model.loader import load_model
from radixserve.model.resolve import resolve_model
from real_model import real_model_dir  # noqa: F401 (a fixture)

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


def _aligned(nbytes: int) -> np.ndarray:
    """Anonymous bytes starting on a huge page."""
    arr = np.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE), dtype=np.uint8)
    skip = -arr.ctypes.data % HUGE_PAGE
    return arr[skip : skip + nbytes]


def test_the_runs_are_the_whole_pages_the_ranges_touch() -> None:
    a = _aligned(40 * HUGE_PAGE + 100)  # 40 whole pages, then part of one
    base, hp = a.ctypes.data, HUGE_PAGE
    ranges = [(base + hp + 5, 10), (base + 3 * hp - 1, 2), (base + 20 * hp, 20 * hp + 100)]
    # Pages 1, 2-3 (one range across their edge), 20-39 in runs of at most 8; page 40 is not whole.
    assert page_runs(a, ranges) == [(base + hp, 3 * hp), (base + 20 * hp, 8 * hp), (base + 28 * hp, 8 * hp),
                                    (base + 36 * hp, 4 * hp)]  # fmt: skip
    assert page_runs(a[1:], ranges) == []  # a map not on a huge page: none of its pages could be huge


def _vmas(lo: int, hi: int) -> list[tuple[str, str]]:
    """(path, VmFlags) of this process's mappings that overlap [lo, hi)."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            cur = (head[5] if len(head) > 5 else "") if start < hi and end > lo else None
        elif line.startswith("VmFlags:") and cur is not None:
            out.append((cur, line))
    return out


@needs_thp
def test_the_move_keeps_bytes_and_addresses_while_a_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "blocks.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 24 * HUGE_PAGE + 4096, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    base, want = mapped.ctypes.data, zlib.crc32(path.read_bytes())
    runs = page_runs(mapped, [(base, mapped.nbytes)])
    if not runs:
        pytest.skip("the file's map does not start on a huge page here")
    mover = HugePageMover(mapped, runs)
    seen: list[int] = []

    def read() -> None:  # crc32 releases the GIL: it reads the pages while they move
        while not seen or mover._thread.is_alive():
            seen.append(zlib.crc32(mapped))

    reader = threading.Thread(target=read)
    reader.start()
    mover.start().join()
    reader.join()
    assert mover.error is None and mover.moved == 24 * HUGE_PAGE
    assert set(seen) == {want} and mapped.ctypes.data == base and zlib.crc32(mapped) == want
    moved = _vmas(base, base + mover.moved)
    assert moved and all(p == "" and " hg" in flags for p, flags in moved)  # anonymous, advised huge
    assert all(p == str(path) for p, _ in _vmas(base + mover.moved, base + mapped.nbytes))  # the part page


@needs_thp
def test_the_default_model_gives_the_same_tokens_on_huge_pages(real_model_dir, monkeypatch) -> None:  # noqa: F811
    prompts = ["def quicksort(xs):", "The three laws of thermodynamics are"]
    params = {"temperature": 0, "max_new_tokens": 24}
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("RADIXSERVE_HUGE_PAGES", setting)
        with engine_left_at_rest(real_model_dir, quantization="gguf", max_total_tokens=8192) as eng:
            mover = eng.runner.model.huge_pages
            if setting == "1":
                mover.join()
                assert mover.error is None and mover.moved > 300 << 20  # the layers' and LM head's blocks
            else:
                assert mover is None
            outs[setting] = [
                (o["output_ids"], o["meta_info"]["output_token_logprobs"])
                for o in eng.generate(prompts, sampling_params=params, return_logprob=True)
            ]
    assert outs["1"] == outs["0"]


@needs_thp
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: the head is the embedding; llama: q/k rows are copied
def test_the_ranges_moved_are_the_blocks_the_model_reads_in_place(arch, tiny_model_factory, tmp_path) -> None:
    from test_gguf import write_gguf
    from test_gguf_model import TYPES

    gguf_path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tiny_model_factory(arch), TYPES)
    folder = resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    huge_pages.start_early(gguf_path)
    _, model = load_model(folder, torch.float32, quantization="gguf")
    assert huge_pages.take_early(gguf_path) is None  # the load took the early map and its mover
    mapped = model.huge_pages.mapped
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    parts = [p for m in model.modules() if isinstance(m, GGUFLinear) for p in m.parts]
    got = {(p.blocks.data_ptr() - lo, p.blocks.numel()) for p in parts if lo <= p.blocks.data_ptr() < hi}
    assert (len(got) < len(parts)) == (arch == "llama")
    fresh = read_tensor_table(gguf_path)  # another map of the file: compare offsets
    want = {(a - fresh.mapped.ctypes.data, n) for a, n in huge_pages.in_place_ranges(fresh)}
    assert want == got


def test_a_load_that_does_not_take_the_early_map_drops_it(tiny_model_factory, tmp_path) -> None:
    from test_gguf import write_gguf
    from test_gguf_model import TYPES

    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    folder = resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    huge_pages.start_early(gguf_path)
    load_model(folder, torch.float32)  # dequantized: the blocks are not read in place
    assert huge_pages._early is None


@pytest.mark.parametrize(
    ("flags", "early"),
    [([], platform.machine() in ("x86_64", "AMD64")), (["--quantization", "gguf"], True),
     (["--dtype", "float32"], False), (["--quantization", "int8"], False), (["--null-model"], False)],
)  # fmt: skip
def test_serve_starts_the_move_early_where_the_blocks_will_be_read(
    flags, early, tiny_model_factory, tmp_path, monkeypatch
) -> None:
    from test_gguf import write_gguf
    from test_gguf_model import TYPES

    from radixserve.cli import main

    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    seen = []
    fake = types.ModuleType("radixserve.server.launch")
    fake.run_server = lambda *a, **k: seen.append(huge_pages.take_early(gguf_path))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "radixserve.server.launch", fake)
    assert main(["serve", "--model", str(gguf_path), "--cache-dir", str(tmp_path / "cache"), *flags]) == 0
    assert (seen[0] is not None) == early
