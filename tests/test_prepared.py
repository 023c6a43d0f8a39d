"""The prepared copy of a converted model's weights (radixserve/model/prepared.py) and deferred oneDNN packing
(radixserve/model/packing.py): a later load maps exactly the tensors a fresh build gives, a stale, foreign or broken
copy is rebuilt, a user's folder is never written to, and deferred packing changes no output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from radixserve.model import loader
from radixserve.model.llama import Linear, can_pack
from radixserve.model.loader import load_model, load_unpacked
from radixserve.model.packing import DeferredPacking
from radixserve.model.prepared import PREPARED_DIR, prepared_file
from radixserve.model.resolve import resolve_model

TYPES = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "ffn_gate": T.Q4_0, "ffn_up": T.Q5_0, "output": T.Q8_0}
FORMATS = [(torch.bfloat16, "int8"), (torch.bfloat16, "int4"), (torch.bfloat16, "none"), (torch.float32, "int8")]


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory) -> Path:
    """A tiny Qwen2 GGUF (Q8_0 / Q4_0 / Q5_0 blocks) converted by resolve_model: a folder that gets prepared copies."""
    from test_gguf import write_gguf

    root = tmp_path_factory.mktemp("prepared")
    gguf_path = write_gguf(root / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    return resolve_model(gguf_path, cache_dir=root / "cache", progress=False)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_dense() if v.is_mkldnn else v for k, v in model.state_dict().items()}


def _no_build(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count fresh builds instead of failing, so a test can assert how many happened."""
    calls: list[int] = []
    real = loader._build

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "_build", counting)
    return calls


@pytest.mark.parametrize(("dtype", "fmt"), FORMATS, ids=[f"{d}-{f}".replace("torch.", "") for d, f in FORMATS])
def test_second_load_maps_the_same_tensors(converted, monkeypatch, dtype, fmt):
    builds = _no_build(monkeypatch)
    target = prepared_file(converted, dtype, fmt)
    target.unlink(missing_ok=True)
    _, fresh = load_unpacked(converted, dtype, quantization=fmt)
    assert target.is_file() and builds == [1]
    _, mapped = load_unpacked(converted, dtype, quantization=fmt)
    assert builds == [1]  # the second load built nothing
    a, b = _state(fresh), _state(mapped)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    hidden = torch.randn(3, fresh.config.hidden_size, dtype=dtype)
    assert torch.equal(fresh.eval().compute_logits(hidden), mapped.eval().compute_logits(hidden))


def test_stale_foreign_or_broken_copies_are_rebuilt(converted, monkeypatch):
    builds = _no_build(monkeypatch)
    target = prepared_file(converted, torch.bfloat16, "int8")
    target.unlink(missing_ok=True)
    load_unpacked(converted, torch.bfloat16, quantization="int8")
    assert builds == [1]
    (converted / "config.json").touch()  # a changed input: the fingerprint no longer matches
    load_unpacked(converted, torch.bfloat16, quantization="int8")
    assert builds == [1, 1]
    other = prepared_file(converted, torch.bfloat16, "int4")
    load_unpacked(converted, torch.bfloat16, quantization="int4")
    other.replace(target)  # another format's file under this name: its metadata is for int4
    load_unpacked(converted, torch.bfloat16, quantization="int8")
    assert len(builds) == 4
    target.write_bytes(target.read_bytes()[:1000])  # truncated
    _, model = load_unpacked(converted, torch.bfloat16, quantization="int8")
    assert len(builds) == 5 and model.compute_logits(torch.zeros(1, model.config.hidden_size)).isfinite().all()


def test_a_copy_that_cannot_be_saved_costs_only_the_next_start(converted, monkeypatch, caplog):
    from radixserve.model import prepared

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepared, "save_file", full_disk)
    target = prepared_file(converted, torch.bfloat16, "int4")
    target.unlink(missing_ok=True)
    _, model = load_model(converted, torch.bfloat16, quantization="int4")
    assert not target.exists() and "could not save the prepared weights" in caplog.text
    assert model.compute_logits(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)).isfinite().all()


def test_only_converted_folders_get_a_copy_and_float32_dense_never(tiny_model_factory, converted):
    user = tiny_model_factory("qwen2")
    load_model(user, torch.bfloat16, quantization="int8")
    assert not (user / PREPARED_DIR).exists()  # a user's folder is never written to
    load_model(converted, torch.float32)
    assert not prepared_file(converted, torch.float32, "none").exists()  # dequantized in memory at each load


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels for this CPU")
def test_deferred_packing_changes_no_output(converted):
    _, eager = load_model(converted, torch.bfloat16)
    config, lazy = load_unpacked(converted, torch.bfloat16)
    jobs = lazy.packing_jobs()
    packing = DeferredPacking(jobs)  # never started: each module must pack itself before its first forward
    lazy.eval()
    hidden = torch.randn(4, config.hidden_size, dtype=torch.bfloat16)
    assert packing.pending == len(jobs) > 0
    assert torch.equal(lazy.compute_logits(hidden), eager.compute_logits(hidden))
    assert packing.pending == len(jobs) - 1  # the head packed itself; the layers are still due
    packing.start()
    packing.wait()
    assert packing.pending == 0
    assert all(m.weight.is_mkldnn for m in lazy.modules() if isinstance(m, Linear))
