"""GGUF block mapping (radixserve/gguf/blocks.py): Q4_0 / Q4_K -> int4 groups exactly, Q8_0 -> per-channel int8
(exact when a row shares one block scale, else requantized within half a per-row step); compared against gguf's own
dequantizer, and through the int4/int8 linears."""

from __future__ import annotations

import gguf
import pytest
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from radixserve.gguf.blocks import q4_0_to_int4, q4_k_to_int4, q8_0_to_int8
from radixserve.model.quant import Int4Linear, Int8Linear, dequantize_int4, dequantize_int8

SHAPE = (32, 512)


def _weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _reference(data: np.ndarray, typ: T) -> np.ndarray:
    return gguf.quants.dequantize(data, typ).reshape(SHAPE)


def _random_q4_k(seed: int = 0) -> np.ndarray:
    """Q4_K super-blocks with random codes and 6-bit scales/mins (gguf-py has no Q4_K quantizer); d, dmin finite."""
    rng = np.random.default_rng(seed)
    n, k = SHAPE
    b = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    b[..., 0:4] = rng.uniform(0.001, 0.05, (n, k // 256, 2)).astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
    return b.reshape(n, -1)


def test_q4_0_maps_to_int4_exactly():
    data = gguf.quants.quantize(_weights(), T.Q4_0)
    m = q4_0_to_int4(data, SHAPE)
    assert m.q.min() >= 0 and m.q.max() <= 15 and m.scale.shape == (SHAPE[0], SHAPE[1] // 32)
    assert np.array_equal(dequantize_int4(m.q, m.scale, m.zero).numpy(), _reference(data, T.Q4_0))


def test_q4_k_maps_to_int4_groups_of_32():
    data = _random_q4_k()
    ref = _reference(data, T.Q4_K)
    m = q4_k_to_int4(data, SHAPE)
    out = dequantize_int4(m.q, m.scale, m.zero).numpy()
    # Same values up to float32 rounding of (q - 8) * scale + zero vs q * scale - min.
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_q8_0_maps_to_per_channel_int8():
    w = _weights()
    data = gguf.quants.quantize(w, T.Q8_0)
    ref = _reference(data, T.Q8_0)
    m = q8_0_to_int8(data, SHAPE)
    assert not m.exact  # random rows: every block has its own scale, so the codes are requantized
    err = np.abs(dequantize_int8(m.q, m.scale).numpy() - ref)
    assert np.all(err <= m.scale.numpy()[:, None] / 2 + 1e-6)
    # Rows whose blocks share one scale (each block holds a 127 code and d = 0.5/127) keep their codes as they are.
    codes = np.random.default_rng(1).integers(-127, 128, SHAPE)
    codes[:, ::32] = 127
    data = gguf.quants.quantize((codes * (0.5 / 127)).astype(np.float32), T.Q8_0)
    m = q8_0_to_int8(data, SHAPE)
    assert m.exact
    assert np.array_equal(dequantize_int8(m.q, m.scale).numpy(), _reference(data, T.Q8_0))


def test_mapped_blocks_run_through_the_quantized_linears():
    x = torch.randn(4, SHAPE[1])
    data = _random_q4_k(1)
    m = q4_k_to_int4(data, SHAPE)
    ref = x @ torch.from_numpy(_reference(data, T.Q4_K)).T
    y = Int4Linear(m.q, m.scale, m.zero, None)(x)
    assert ((y - ref).norm() / ref.norm()).item() <= 0.01  # bf16 rounding of x, scale/zero and y only
    data = gguf.quants.quantize(_weights(2), T.Q8_0)
    m8 = q8_0_to_int8(data, SHAPE)
    ref = x @ torch.from_numpy(_reference(data, T.Q8_0)).T
    y = Int8Linear(m8.q, m8.scale, None)(x)
    assert ((y - ref).norm() / ref.norm()).item() <= 0.015


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # llama: llama.cpp's permuted Q/K rows are undone on the codes
def test_loader_takes_int4_codes_from_the_gguf_blocks(arch, tiny_model_factory, tmp_path):
    from test_gguf import write_gguf

    from radixserve.model.loader import _gguf_blocks, load_model
    from radixserve.model.quant import quantize_model
    from radixserve.model.resolve import resolve_model

    types = {
        "attn_q": T.Q4_0,
        "attn_k": T.Q4_0,
        "attn_v": T.Q4_0,
        "attn_output": T.Q8_0,
        "ffn_gate": T.Q4_0,
        "ffn_up": T.Q4_0,
        "ffn_down": T.Q4_0,
        "token_embd": T.Q8_0,
        "output": T.Q8_0,
    }
    gguf_path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tiny_model_factory(arch), types)
    folder = resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    cfg, model = load_model(folder, torch.float32)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    count, from_gguf = quantize_model(model, "int4", mapped=_gguf_blocks(folder, "int4", cfg))
    assert from_gguf == 3 * cfg.num_layers  # qkv, gate_up, down; o_proj (Q8_0) and the head come from floats
    for i in range(cfg.num_layers):
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            lin = model.get_submodule(f"layers.{i}.{name}")
            w = lin(torch.eye(lin.in_features)).T - (0 if lin.bias is None else lin.bias[:, None])
            ref = dense[f"layers.{i}.{name}.weight"]
            # The GGUF's own values, up to bf16 rounding of scale/zero and output; a requantized copy would be ~8% off.
            assert ((w - ref).norm() / ref.norm()).item() <= 0.01, (i, name)
    _, model8 = load_model(folder, torch.float32)
    _, from_gguf = quantize_model(model8, "int8", mapped=_gguf_blocks(folder, "int8", cfg))
    assert from_gguf == cfg.num_layers + 1  # every o_proj and the LM head (Q8_0: a tied head from the embedding)
