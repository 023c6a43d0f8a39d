"""The CUDA path's fused ops (radixserve_kernels/cuda_ops.py, FlashInfer's norm/activation/rope) as the model calls
them.

On CPU a stand-in for flashinfer with the documented semantics (in place, float32 inside, one rounding) checks the
call shapes: which tensor each op overwrites, gate before up, the cos|sin cache layout, the heads flattened from the
qkv projection's strided columns, the residual threaded through every layer. With a GPU and flashinfer, the real
kernels are compared with the torch ops they replace.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import radixserve_kernels.cpu as cpu_kernels
import radixserve_kernels.cuda_ops as cuda_ops
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.model.rope import RotaryEmbedding, apply_rope, lookup
from tiny_models import make_tiny_checkpoint


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class FakeFlashInfer(SimpleNamespace):
    """flashinfer.norm / activation / rope as documented, in float32 with one rounding; counts the calls."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        super().__init__(
            calls=self.calls,
            norm=SimpleNamespace(rmsnorm=self._counted(self.rmsnorm), fused_add_rmsnorm=self._counted(self.add_norm)),
            activation=SimpleNamespace(silu_and_mul=self._counted(self.silu_and_mul)),
            rope=SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=self._counted(self.rope)),
        )

    def _counted(self, fn):
        def call(*args, **kwargs):
            self.calls[fn.__name__] = self.calls.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)

        return call

    @staticmethod
    def rmsnorm(input, weight, eps=1e-6):
        return _norm(input.float(), weight, eps).to(input.dtype)

    @staticmethod
    def add_norm(input, residual, weight, eps=1e-6):
        x = input.float() + residual.float()
        residual.copy_(x)
        input.copy_(_norm(x, weight, eps))

    @staticmethod
    def silu_and_mul(input):
        gate, up = input.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(input.dtype)

    @staticmethod
    def rope(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert cos_sin_cache.dtype == torch.float32 and is_neox
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        for x in (query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)):
            x1, x2 = x.float().chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def test_add_rms_norm_overwrites_its_inputs_with_sum_and_norm() -> None:
    ops = cuda_ops.FusedOps(FakeFlashInfer())
    h, res, w = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16(), torch.randn(64).bfloat16()
    expect_sum = h + res
    total, normed = ops.add_rms_norm(h, res, w, 1e-6)
    assert total is res and normed is h  # in place: the caller must not need either input afterwards
    assert torch.equal(total, expect_sum)
    torch.testing.assert_close(normed.float(), _norm(expect_sum.float(), w, 1e-6), rtol=2e-2, atol=2e-2)


def test_shapes_the_kernels_do_not_take_fall_back() -> None:
    ops = cuda_ops.FusedOps(FakeFlashInfer())
    w = torch.randn(20).bfloat16()
    assert ops.add_rms_norm(torch.randn(3, 20).bfloat16(), None, torch.randn(20).bfloat16(), 1e-6) is None  # 40 B
    assert ops.add_rms_norm(torch.randn(3, 4, 20).bfloat16(), None, w, 1e-6) is None  # 3-D (QK norm)
    assert ops.silu_mul(torch.randn(3, 2 * 20).bfloat16()) is None
    q, k = torch.randn(3, 4, 16).bfloat16(), torch.randn(3, 2, 16).bfloat16()
    cache = RotaryEmbedding(16, 32, 10000.0, None).cos_sin_cache
    assert not ops.rope_qk(q, k, torch.arange(3), cache)  # head_dim 16: no FlashInfer kernel


def test_rope_qk_rotates_the_qkv_columns_in_place() -> None:
    ops = cuda_ops.FusedOps(FakeFlashInfer())
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    qkv = torch.randn(6, (4 + 2 + 2) * 64)
    q, k, v = (p.view(6, -1, 64) for p in qkv.split([256, 128, 128], dim=-1))
    before_v, positions = v.clone(), torch.tensor([0, 5, 6, 7, 100, 3])
    cos, sin = lookup(rotary.cos_sin_cache, positions, torch.float32)
    want_q, want_k = apply_rope(q.clone(), cos, sin), apply_rope(k.clone(), cos, sin)
    assert ops.rope_qk(q, k, positions, rotary.cos_sin_cache)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(v, before_v)


def _forward(model, config, prompts: list[list[int]]) -> torch.Tensor:
    page = 4
    pool = KVPool(config.num_layers, 64, page, config.num_kv_heads, config.head_dim, torch.bfloat16)
    attn = TorchAttentionBackend(pool, config.num_heads, config.head_dim)
    free = list(range(1, 64))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(p) // page))] for p in prompts]
    total = sum(map(len, prompts))
    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, page, list(range(total)))
    attn.plan(batch)
    with torch.no_grad():
        return model.compute_logits(model(batch, attn)[batch.logits_indices])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_through_the_fused_ops_matches_the_torch_path(arch, tmp_path, monkeypatch) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, vocab_size=256, hidden_size=128, head_dim=64, intermediate_size=256)
    config, model = load_model(path, torch.bfloat16)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((9, 1, 17))]
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)  # the CPU kernels would take these calls first
    plain = _forward(model, config, prompts)
    fake = FakeFlashInfer()
    monkeypatch.setattr(cuda_ops, "for_tensor", lambda x: cuda_ops.FusedOps(fake) if x.dtype != torch.float32 else None)
    fused = _forward(model, config, prompts)
    layers = config.num_layers
    # Every residual add is fused: one plain norm (layer 0's input), two add+norms per layer and the final one.
    assert fake.calls == {"rmsnorm": 1, "add_norm": 2 * layers, "silu_and_mul": layers, "rope": layers}
    rel = (fused - plain).norm() / plain.norm()
    assert rel < 2e-2, rel  # bfloat16: the two round at different places


cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available() or cuda_ops._ops() is None, reason="needs a GPU and flashinfer"
)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_ops_match_the_torch_ops(dtype) -> None:
    ops, dev = cuda_ops._ops(), torch.device("cuda")
    h, res, w = (torch.randn(37, 4096, device=dev, dtype=dtype) for _ in range(3))
    w = w[0]
    want_sum = h + res
    want_norm = w * F.rms_norm(want_sum, (4096,), eps=1e-5)
    total, normed = ops.add_rms_norm(h.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(total, want_sum)
    torch.testing.assert_close(normed, want_norm, rtol=2e-2, atol=2e-2)
    gate_up = torch.randn(37, 2 * 1024, device=dev, dtype=dtype)
    gate, up = gate_up.split(1024, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-2, atol=2e-2)
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).to(dev)
    qkv = torch.randn(37, (32 + 8 + 8) * 128, device=dev, dtype=dtype)
    q, k, _ = (p.view(37, -1, 128) for p in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    positions = torch.randint(0, 4096, (37,), device=dev)
    cos, sin = lookup(rotary.cos_sin_cache, positions, dtype)
    want_q, want_k = apply_rope(q.clone(), cos, sin), apply_rope(k.clone(), cos, sin)
    assert ops.rope_qk(q, k, positions, rotary.cos_sin_cache)
    torch.testing.assert_close(q, want_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k, want_k, rtol=2e-2, atol=2e-2)
