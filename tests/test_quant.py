"""Int8 weight-only linears against float32 matmul, and the CPU-aware choice of dtype/quantization (issue 14)."""
from __future__ import annotations

import pytest
import torch

from radixserve.model import cpu_select
from radixserve.model.llama import Linear
from radixserve.model.quant import INT8_REL_TOL, Int8Linear, dequantize_int8, quantize_int8


@pytest.mark.parametrize("shape", [(1, 64, 96), (3, 896, 128), (17, 128, 4864), (96, 256, 33)])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_float32_matmul(shape, act):
    torch.manual_seed(sum(shape))
    m, k, n = shape
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    lin = Int8Linear.from_float(w, b)
    y = lin(x.to(act)).float()
    exact = x @ w.T + b
    # Tolerance: int8 rounding (INT8_REL_TOL of the output spread) plus bf16 rounding of x and y (the op runs in bf16).
    tol = (INT8_REL_TOL + 0.02) * exact.abs().max().item()
    assert y.shape == (m, n)
    assert (y - exact).abs().max().item() <= tol
    # Against the dequantized weight the packed op is exact up to bf16 rounding of x and y (it runs in bf16).
    deq = x @ dequantize_int8(lin.qweight, lin.scale).T + b
    assert (y - deq).abs().max().item() <= 0.02 * deq.abs().max().item()
    assert lin(x.to(act)).dtype == act


def test_int8_quantize_round_trip_and_zero_rows():
    w = torch.randn(8, 32)
    w[3] = 0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (8,) and q.abs().max() <= 127
    assert torch.all(q[3] == 0)
    err = (dequantize_int8(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-6)  # at most half a quantization step per row


def test_load_model_int8_replaces_every_linear_and_the_tied_head(tmp_path):
    from radixserve.model.loader import load_model
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # tied embeddings
    cfg, ref = load_model(path, torch.float32)
    _, model = load_model(path, torch.float32, quantization="int8")
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * cfg.num_layers + 1
    hidden = torch.randn(5, cfg.hidden_size)
    before, after = ref.compute_logits(hidden), model.compute_logits(hidden)
    assert (after - before).abs().max().item() <= INT8_REL_TOL * before.abs().max().item()


@pytest.mark.parametrize(
    ("cap", "bf16_hw", "expected"),
    [
        ("AVX2", False, ("float32", "none")),  # the EPYC: bf16 is emulated, float32 prefill 5x faster
        ("AVX512", False, ("float32", "none")),  # AVX-512 without BF16
        ("AVX512", True, ("bfloat16", "none")),  # AVX-512-BF16 / AMX: oneDNN packed bf16 ties or beats int8
    ],
)
def test_auto_choice_per_cpu(monkeypatch, cap, bf16_hw, expected):
    monkeypatch.setattr(cpu_select, "cpu_capability", lambda: cap)
    monkeypatch.setattr(cpu_select, "has_bf16_hardware", lambda: bf16_hw)
    c = cpu_select.choose("auto", "auto")
    assert (c.dtype, c.quantization) == expected
    assert f"cpu={cap}" in c.reason


def test_explicit_choices_are_kept_and_bad_ones_refused(monkeypatch):
    monkeypatch.setattr(cpu_select, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_select, "has_bf16_hardware", lambda: False)
    assert cpu_select.choose("bfloat16", "int8").quantization == "int8"
    assert cpu_select.choose("float32", "auto").quantization == "none"
    with pytest.raises(ValueError, match="quantization must be"):
        cpu_select.choose("auto", "int4")
    with pytest.raises(ValueError, match="CPU path"):
        cpu_select.choose("auto", "int8", "cuda")
    assert cpu_select.choose("auto", "auto", "cuda").dtype == "bfloat16"
