"""The dense path of the GGUF linears (radixserve_kernels/cpu/gguf_dense.cpp: blocks dequantized a chunk at a time for
torch's matmul; what a CPU with AMX runs from DENSE_ROWS rows on) against a plain dequantize-then-matmul, and when
GGUFLinear takes it (issue 38)."""

from __future__ import annotations

import pytest
import torch
from test_gguf_kernels import FORMATS, T, ops, random_blocks, reference_weights  # noqa: F401 (ops: a fixture)

from radixserve.model import gguf_linear
from radixserve.model.deterministic import make_deterministic
from radixserve.model.gguf_linear import BlockPart, GGUFLinear


def _parts(k: int, rows: tuple[int, ...], fmts: tuple[T, ...]) -> list[BlockPart]:
    return [BlockPart(torch.from_numpy(random_blocks(f, n, k, seed=n)), f) for f, n in zip(fmts, rows)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dense_equals_dequantize_then_matmul(ops, fmt):
    """300 rows of K = 1024: two chunks of float32 weights (1 MiB each), so a chunk boundary is crossed."""
    k = 1024
    blocks = random_blocks(fmt, 300, k, seed=3)
    w = reference_weights(blocks, fmt).double()
    torch.manual_seed(4)
    x, bias = torch.randn(9, k), torch.randn(300)
    y = ops.gguf_linear_dense(x, [torch.from_numpy(blocks)], [int(fmt)], bias)
    ref = x.double() @ w.T + bias.double()
    magnitude = x.double().abs() @ w.abs().T + bias.double().abs()
    assert y.dtype == torch.float32 and ((y.double() - ref).abs() <= 2.0**-18 * magnitude + 1e-6).all()
    # bfloat16 activations: the weights rounded to bf16 once, the output once more (2^-8 relative each)
    yb = ops.gguf_linear_dense(x.bfloat16(), [torch.from_numpy(blocks)], [int(fmt)], bias)
    refb = x.bfloat16().double() @ w.bfloat16().double().T + bias.bfloat16().double()
    assert yb.dtype == torch.bfloat16
    assert ((yb.double() - refb).abs() <= 2.0**-7 * magnitude + 1e-3).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dense_bf16_weights_are_the_float32_ones_rounded(ops, fmt):
    """The bfloat16 weights the dense path multiplies, read back through one-hot activation rows, bit for bit the
    float32 dequantized weights rounded to nearest even (torch's rounding): the AVX-512 and plain loops agree."""
    k = 512
    blocks = torch.from_numpy(random_blocks(fmt, 70, k, seed=7))
    y = ops.gguf_linear_dense(torch.eye(k, dtype=torch.bfloat16), [blocks], [int(fmt)], None)
    assert torch.equal(y.T, ops.gguf_dequantize(blocks, int(fmt), None).bfloat16())


def test_dense_stacks_parts_of_several_types(ops):
    k = 1024
    parts = _parts(k, (40, 17, 33), (T.Q5_0, T.Q8_0, T.Q4_K))
    torch.manual_seed(5)
    x, bias = torch.randn(6, k), torch.randn(90)
    y = ops.gguf_linear_dense(x, [p.blocks for p in parts], [int(p.type) for p in parts], bias)
    w = torch.cat([reference_weights(p.blocks.numpy(), p.type) for p in parts]).double()
    ref = x.double() @ w.T + bias.double()
    assert ((y.double() - ref).abs() <= 2.0**-18 * (x.double().abs() @ w.abs().T + bias.abs().double()) + 1e-6).all()


def test_gguf_linear_takes_the_dense_path_from_dense_rows(ops, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GGUF_DENSE_ROWS", "8")
    k = 896
    parts = _parts(k, (24, 8), (T.Q5_0, T.Q8_0))
    linear, head = GGUFLinear(parts, k, None), GGUFLinear(parts, k, None, float_output=True)
    assert linear.dense_rows == 8 and not linear.row_invariant
    assert head.dense_rows is None  # the LM head never: a prefill's few logits rows
    blocks, types = [p.blocks for p in parts], [int(p.type) for p in parts]
    torch.manual_seed(6)
    x = torch.randn(8, k).bfloat16()
    assert torch.equal(linear(x[:7]), ops.gguf_linear(x[:7], blocks, types, None))
    assert torch.equal(linear(x), ops.gguf_linear_dense(x, blocks, types, None))

    class Attn:
        batch_invariant_path = True

    make_deterministic(torch.nn.Sequential(linear), Attn())
    assert linear.dense_rows is None and linear.row_invariant
    assert torch.equal(linear(x), ops.gguf_linear(x, blocks, types, None))


def test_dense_rows_default(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_GGUF_DENSE_ROWS", raising=False)
    for kind, rows in (("AMX", gguf_linear.DENSE_ROWS), ("AVX512_BF16", None), ("AVX2", None)):
        monkeypatch.setattr(gguf_linear.cpu_select, "cpu_kind", lambda kind=kind: kind)
        assert gguf_linear.dense_rows_default() == rows
    monkeypatch.setenv("RADIXSERVE_GGUF_DENSE_ROWS", "0")
    assert gguf_linear.dense_rows_default() is None


def test_a_gguf_models_mlp_on_the_dense_path(tiny_model_factory, tmp_path, monkeypatch):
    """A model loaded with the dense path on: the MLP takes DENSE_MLP_ROWS rows a call and stays within bf16's
    rounding of the integer kernels' result."""
    import radixserve.model.llama as llama
    from test_gguf import write_gguf
    from test_gguf_model import TYPES

    from radixserve.model.loader import load_model
    from radixserve.model.resolve import resolve_model

    monkeypatch.setenv("RADIXSERVE_GGUF_DENSE_ROWS", "8")
    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    _, native = load_model(
        resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False), torch.bfloat16, quantization="gguf"
    )
    mlp = native.layers[0].mlp
    assert mlp.gate_up_proj.dense_rows == 8 and not mlp.gate_up_proj.row_invariant
    calls = []
    mlp.gate_up_proj.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    monkeypatch.setattr(llama, "DENSE_MLP_ROWS", 128)
    torch.manual_seed(7)
    x = torch.randn(300, mlp.gate_up_proj.in_features).bfloat16()
    dense = mlp(x)
    assert calls == [128, 128, 44]
    mlp.gate_up_proj.dense_rows = mlp.down_proj.dense_rows = None
    exact = mlp(x)
    assert ((dense.float() - exact.float()).norm() / exact.float().norm()).item() < 0.03
