"""The fused CPU ops of radixserve_kernels/cpu/norm_rope.cpp give the values of the torch sequences they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radixserve_kernels.cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.ops() is None, reason="no C++ toolchain: the CPU kernels cannot be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rope_is_the_torch_rotation(dtype, rows):
    torch.manual_seed(rows)
    qkv = torch.randn(rows, 18 * 64).to(dtype)
    x = qkv[:, : 16 * 64].view(rows, 16, 64)  # strided rows, as Attention passes the q and k heads of qkv
    cos, sin = torch.randn(rows, 1, 32).to(dtype), torch.randn(rows, 1, 32).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(cpu_kernels.ops().rope(x, cos, sin), torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_add_then_norm(dtype, with_residual):
    torch.manual_seed(int(with_residual))
    h, res, w = torch.randn(9, 896).to(dtype), torch.randn(9, 896).to(dtype), torch.randn(896).to(dtype)
    before = h.clone()
    total, normed = cpu_kernels.ops().add_rms_norm(h, res if with_residual else None, w, 1e-6)
    ref_total = h + res if with_residual else h
    assert torch.equal(h, before)  # the input is not written
    assert torch.equal(total, ref_total)
    ref = w * F.rms_norm(ref_total, (896,), eps=1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, ref)
    else:  # torch sums the squares in vector lanes, the op in double: within an ulp or two
        torch.testing.assert_close(normed, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
def test_rope_rotates_q_and_k_of_one_qkv_row_in_one_op(rows, monkeypatch):
    """Attention's q and k views of the qkv output (strided rows; at one token `view` gives them different, moot
    row strides) are rotated by one op a layer, rope_qk, with the values of rotating each alone."""
    from radixserve.model import rope

    torch.manual_seed(rows)
    qkv = torch.randn(rows, 18 * 64).bfloat16()
    q, k, _ = (part.view(rows, -1, 64) for part in qkv.split([14 * 64, 2 * 64, 2 * 64], dim=-1))
    cos, sin = torch.randn(rows, 1, 32).bfloat16(), torch.randn(rows, 1, 32).bfloat16()
    alone = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    calls = []
    ops = cpu_kernels.ops()
    counted = type("Counted", (), {"rope_qk": lambda self, *a: calls.append("rope_qk") or ops.rope_qk(*a)})()
    monkeypatch.setattr(rope.cpu_kernels, "ops", lambda: counted)
    monkeypatch.setattr(rope, "apply_rope", lambda *a: calls.append("apply_rope") or alone)
    rq, rk = rope.RopeStep(torch.arange(rows), cos, sin, torch.empty(0), None).rotate(q, k)
    assert calls == ["rope_qk"]
    assert torch.equal(rq, alone[0]) and torch.equal(rk, alone[1])


def _all_bfloat16() -> torch.Tensor:
    """Every bfloat16 value but the NaNs, in rows of 4,864 (the default model's MLP width)."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[~torch.isnan(every.float())]
    return every[: every.numel() - every.numel() % 4864].view(-1, 4864)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_torchs_silu_times_up(dtype):
    """Every bfloat16 value as a gate (in float32 too), and widths with torch's scalar tail: the same values as
    F.silu(gate) * up, NaN for NaN (gate -inf)."""
    torch.manual_seed(0)
    gate = _all_bfloat16().to(dtype)
    up = torch.randn(gate.shape).to(dtype)
    got = cpu_kernels.ops().silu_mul(torch.cat([gate, up], 1))
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=0, atol=0, equal_nan=True)
    for width in (1, 33, 100, 4864 + 17):
        gate_up = (torch.randn(3, 2 * width) * 8).to(dtype)
        gate, up = gate_up.split(width, 1)
        assert torch.equal(cpu_kernels.ops().silu_mul(gate_up), F.silu(gate) * up)
    # Eight rows run in pieces on the spin pool: the values of each row alone (on the calling thread), the tail
    # included. (Against torch itself a build for another ISA than torch's differs at the tail: other vector steps.)
    gate_up = (torch.randn(8, 2 * (4864 + 17)) * 8).to(dtype)
    alone = torch.cat([cpu_kernels.ops().silu_mul(row[None]) for row in gate_up])
    assert torch.equal(cpu_kernels.ops().silu_mul(gate_up), alone)
