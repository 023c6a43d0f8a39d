"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with QKV bias, Qwen3 with QK-norm) over a packed batch.

q/k/v and gate/up are fused into one Linear each at load time; attention goes through an `AttentionBackend`,
which owns the KV pool. Weight names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...).
On CPU in bfloat16 the loader then calls `pack_for_cpu()`, which swaps every Linear weight (and the LM head) for a
oneDNN-blocked copy: decode steps are matrix-vector products bound by memory bandwidth, and oneDNN streams a
prepacked weight 2-3x faster than `F.linear` does a plain one, with the same float32 accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

import radixserve_kernels.cpu as cpu_kernels
import radixserve_kernels.cuda_ops as cuda_ops

from radixserve.attention.base import AttentionBackend
from radixserve.config import ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cpu_stack import run_stack
from radixserve.model.rope import RopeStep, RotaryEmbedding


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight multiply, as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[1]

    def add_forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + residual, the norm of that); may overwrite both inputs. On CPU one fused op
        (radixserve_kernels/cpu/norm_rope.cpp) with the same roundings replaces the add, the norm and the weight
        multiply; on CUDA FlashInfer's fused add + RMSNorm (radixserve_kernels/cuda_ops.py) does."""
        ops = cpu_kernels.ops() if h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None and h.dim() == 2 and self.weight.dtype == h.dtype:
            return ops.add_rms_norm(h, residual, self.weight, self.eps)
        fused = cuda_ops.for_tensor(h)
        done = fused.add_rms_norm(h, residual, self.weight, self.eps) if fused is not None else None
        if done is not None:
            return done
        if residual is not None:
            h = h + residual
        # F.rms_norm accumulates bf16/fp16 input in float32 and rounds once: the same values as
        # rms_norm(x.float()).to(x.dtype), without the two copies.
        return h, self.weight * F.rms_norm(h, (h.shape[-1],), eps=self.eps)


class Linear(nn.Module):
    """y = x W^T + b, like nn.Linear but with no random init (every weight comes from the checkpoint).

    `pack` may replace the weight by a oneDNN-blocked copy; the result is the same.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @torch.no_grad()
    def pack(self) -> None:
        """Reorder the weight in place into oneDNN's blocked layout (CPU, bf16); frees the plain copy."""
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """True where `pack_for_cpu` pays: CPU, bfloat16, and a oneDNN build with bf16 kernels for this CPU."""
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, _o_proj_bias(config), dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        # `[num_kv_heads, head_dim]` subtracted from every key after RoPE (int8 KV pages: radixserve/model/key_center.py)
        self.k_center: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RopeStep, attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (
            part.view(t, -1, self.head_dim)
            for part in self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.rotate(q, k)
        if self.k_center is not None:
            k = k.sub_(self.k_center)  # in place: k is this step's own (the qkv output or RoPE's result)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


# A prefill chunk's MLP runs this many rows at a time where a linear's rows do not depend on each other
# (`row_invariant`: the GGUF block kernels). The gate_up output and its SiLU product were a 512-row chunk's largest
# tensors (30 MB in float32), and how glibc reused them moved the peak RSS of a 1,000-token prefill by up to 53 MiB
# from run to run; at 128 rows it held at 785 MiB in every run, the prefill as fast within the noise, and the issue's
# benchmark on AVX2 (float32 activations) peaked at 785 MiB against 825 (RESULTS.md, issue 38 session 21).
MLP_ROWS = 128
# Where the linears instead take a dense matmul from some row count (GGUF blocks on a CPU with AMX:
# gguf_linear.DENSE_ROWS; not row-invariant either way), DENSE_MLP_ROWS at a time, a default prefill chunk's rows:
# each call dequantizes all of the MLP's weights, so fewer, larger calls pay. In process, fresh processes alternated,
# a 1,000-token prefill took 1.03-1.13 s at 512 rows against 1.16-1.31 at 256, the peak RSS 811-815 MiB against 799
# (the benchmark: 802 MiB, llama-server 851-880; RESULTS.md, issue 38 session 37).
DENSE_MLP_ROWS = 512


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._split_rows()
        if rows is not None and x.shape[0] > rows:
            return torch.cat([self._rows(part) for part in x.split(rows)])
        return self._rows(x)

    def _split_rows(self) -> int | None:
        """Rows a call, None for one call. Row-invariant linears (the GGUF integer kernels) give each row the same
        result however the rows are split: MLP_ROWS, for the peak RSS. The GGUF dense path's sums depend on the row
        count in one call too: DENSE_MLP_ROWS. Others (int8, float weights): one call, as before."""
        projs = (self.gate_up_proj, self.down_proj)
        if all(getattr(p, "row_invariant", False) for p in projs):
            return MLP_ROWS
        if all(getattr(p, "dense_rows", None) is not None for p in projs):
            return DENSE_MLP_ROWS
        return None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = _cpu_silu_mul(gate_up)
        if act is None:
            fused = cuda_ops.for_tensor(gate_up)
            act = fused.silu_mul(gate_up) if fused is not None else None
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        del gate_up  # freed before down runs: at a prefill chunk it is the step's largest tensor (peak RSS)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer adds the two in its first
        norm, so every residual add is fused into a norm (the last one into the model's final norm)."""
        residual, x = self.input_layernorm.add_forward(h, residual)
        residual, x = self.post_attention_layernorm.add_forward(self.self_attn(x, rope, attn), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; `forward` runs one packed step, `compute_logits` projects chosen rows.

    Weights are allocated in `dtype` (default: torch's) and left uninitialized: `load_weights` fills every one.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        # An explicit weight skips nn.Embedding's random init (a pass over vocab x hidden for nothing).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.tied_head: Linear | None = None  # pack_for_cpu's packed copy of a tied embedding
        self.packing = None  # a DeferredPacking (radixserve/model/packing.py) when the loader deferred packing
        self.cpu_stack = None  # the layers as one C++ call on CPU (radixserve/model/cpu_stack.py), set by the runner
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm for every packed token; writes each layer's K/V via `attn`."""
        h = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, h.dtype, cuda_ops.for_tensor(h))
        if self.cpu_stack is not None:
            out = run_stack(self.cpu_stack, h, rope, attn, self.norm.weight.dtype)
            if out is not None:
                return out
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, attn)
        return self.norm.add_forward(h, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab]` in float32 for hidden rows `[N, hidden]` (select `batch.logits_indices` first)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            return head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def pack_for_cpu(self) -> None:
        """Prepack every projection for oneDNN (see the module docstring); call once, after `load_weights`."""
        for _, pack in self.packing_jobs():
            pack()

    def packing_jobs(self) -> list[tuple[nn.Module, Callable[[], None]]]:
        """(module, its packing) for every projection not packed yet; radixserve/model/packing.py may run them
        later. A tied LM head gets its own Linear now, sharing the embedding's rows until it is packed into its
        own copy (vocab x hidden more memory: 272 MB for Qwen2.5-0.5B in bf16), since the lookup needs plain rows.
        """
        if self.lm_head is None and self.tied_head is None:
            with torch.device("meta"):
                self.tied_head = Linear(self.config.hidden_size, self.config.vocab_size, False)
            self.tied_head.weight = nn.Parameter(self.embed_tokens.weight.detach(), requires_grad=False)
        return [(m, m.pack) for m in self.modules() if isinstance(m, Linear) and not m.weight.is_mkldnn]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; raise on unknown, duplicate or missing names."""
        targets = self._hf_targets()
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints save the RoPE buffer; we compute our own
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store a copy of the embedding
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            if name in seen:
                raise ValueError(f"weight {name!r} appears twice in the checkpoint")
            param, offset, rows = targets[name]
            if tuple(tensor.shape) != (rows, *param.shape[1:]):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {(rows, *param.shape[1:])}"
                )
            param[offset : offset + rows].copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} weight(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )

    def hf_parts(self) -> dict[str, list[str]]:
        """Our parameter name -> the Hugging Face tensor names stacked into it, in row order (q, k, v; gate, up)."""
        by_param = {id(p): n for n, p in self.named_parameters()}
        parts: dict[str, list[tuple[int, str]]] = {}
        for hf_name, (param, offset, _) in self._hf_targets().items():
            parts.setdefault(by_param[id(param)], []).append((offset, hf_name))
        return {name: [hf for _, hf in sorted(rows)] for name, rows in parts.items()}

    def _hf_targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Every Hugging Face weight name the model needs -> (our parameter, first row in it, number of rows)."""
        c = self.config
        q_size, kv_size, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        # Our fused module -> its Hugging Face parts as (module name, rows), stacked in this order.
        parts = {
            "self_attn.qkv_proj": [
                ("self_attn.q_proj", q_size),
                ("self_attn.k_proj", kv_size),
                ("self_attn.v_proj", kv_size),
            ],
            "mlp.gate_up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
        }
        targets: dict[str, tuple[nn.Parameter, int, int]] = {}
        for name, param in self.named_parameters():
            hf_name = name if name.startswith("lm_head.") else f"model.{name}"
            module, _, kind = hf_name.rpartition(".")
            fused = next((f for f in parts if module.endswith("." + f)), None)
            if fused is None:
                targets[hf_name] = (param, 0, param.shape[0])
                continue
            prefix, offset = module.removesuffix(fused), 0
            for part, rows in parts[fused]:
                targets[f"{prefix}{part}.{kind}"] = (param, offset, rows)
                offset += rows
        return targets


def _cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up as one op on CPU (radixserve_kernels/cpu/silu_mul.cpp: torch's values, without the split, the two
    dispatches and the intermediate), or None where it does not apply."""
    if gate_up.device.type != "cpu" or gate_up.dim() != 2 or gate_up.dtype not in (torch.float32, torch.bfloat16):
        return None
    ops = cpu_kernels.ops()
    return ops.silu_mul(gate_up) if ops is not None else None


def _o_proj_bias(config: ModelConfig) -> bool:
    """Qwen2 has bias on q/k/v only; Llama/Qwen3 with `attention_bias` put it on o_proj too."""
    return config.architecture != "Qwen2ForCausalLM" and bool(config.hf_config.get("attention_bias", False))
