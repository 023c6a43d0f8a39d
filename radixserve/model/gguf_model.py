"""Build a LlamaForCausalLM straight from a GGUF file's tensors as they are (weight format "gguf", issue 38).

Every projection becomes a GGUFLinear over the file's blocks (memory-mapped: nothing is copied or dequantized at
load), the token embedding a GGUFEmbedding, the LM head the file's `output.weight` blocks (or the embedding's, when
tied); only the float32 norms and biases are read into tensors. llama.cpp's Q/K row order (Llama files) is undone
on the block rows, which are independent.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from radixserve.config import ModelConfig
from radixserve.gguf import huge_pages
from radixserve.gguf.reader import PERMUTED_ARCHITECTURES, hf_tensor_name, unpermute_rows
from radixserve.gguf.tensor_table import TensorTable, read_tensor_table
from radixserve.model.gguf_linear import KERNEL_TYPES, BlockPart, GGUFEmbedding, GGUFLinear
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.rope import RotaryEmbedding

# Our fused projection -> the GGUF tensors stacked into it, in row order (as LlamaForCausalLM._hf_targets).
_FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


class _Tensors:
    """The GGUF's tensors by name: quantized ones as BlockParts over the memory map, float ones as tensors."""

    def __init__(self, table: TensorTable, config: ModelConfig) -> None:
        self.by_name = table.tensors
        self.permuted = table.architecture in PERMUTED_ARCHITECTURES
        self.config = config

    def part(self, name: str) -> BlockPart:
        t = self.by_name[name]
        raw = t.data.reshape(t.shape[0], -1)
        if self.permuted and ".attn_q." in name:
            raw = np.ascontiguousarray(unpermute_rows(raw, self.config.num_heads))
        elif self.permuted and ".attn_k." in name:
            raw = np.ascontiguousarray(unpermute_rows(raw, self.config.num_kv_heads))
        with warnings.catch_warnings():  # the map is read-only; nothing writes to these tensors
            warnings.simplefilter("ignore", UserWarning)
            return BlockPart(torch.from_numpy(raw), t.type)

    def floats(self, name: str) -> torch.Tensor | None:
        """A float tensor (norm weight, bias) as float32, or None if the file has no such tensor."""
        t = self.by_name.get(name)
        if t is None:
            return None
        if t.type != GGMLQuantizationType.F32:
            raise ValueError(f"GGUF tensor {name} is {t.type.name}; norms and biases are read as F32")
        w = t.data.view(np.float32)
        if self.permuted and (".attn_q.bias" in name or ".attn_k.bias" in name):
            heads = self.config.num_heads if ".attn_q." in name else self.config.num_kv_heads
            w = unpermute_rows(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32))


def _linear(tensors: _Tensors, layer: int, gguf_names: tuple[str, ...], in_features: int) -> GGUFLinear:
    parts = [tensors.part(f"blk.{layer}.{n}.weight") for n in gguf_names]
    biases = [tensors.floats(f"blk.{layer}.{n}.bias") for n in gguf_names]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(p.rows) for b, p in zip(biases, parts)])
    return GGUFLinear(parts, in_features, bias)


def _assign_floats(model: LlamaForCausalLM, tensors: _Tensors, dtype: torch.dtype) -> None:
    """The norm weights (every parameter left once the projections are replaced), cast to `dtype`."""
    for name, param in list(model.named_parameters()):
        if isinstance(model.get_submodule(name.rpartition(".")[0]), GGUFLinear):
            continue
        gguf_name = next((g for g in tensors.by_name if hf_tensor_name(g) == f"model.{name}"), None)
        value = None if gguf_name is None else tensors.floats(gguf_name)
        if value is None or value.numel() != param.numel():
            raise ValueError(f"the GGUF has no tensor for {name} {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = nn.Parameter(value.reshape(param.shape).to(dtype), requires_grad=False)


# What each linear hands the pool to prefetch (the kernel takes at most 8 MB of it): the next linears' blocks
# up to this many bytes, so the list stays short.
_AHEAD_BYTES = 8 << 20


def _prefetch_in_step_order(model: LlamaForCausalLM, head: GGUFLinear) -> None:
    """Each linear of a decode step prefetches the blocks of the linears after it, in the order a step runs them
    (each layer's qkv, o, gate_up, down, then the LM head, then the next step's first layer)."""
    order = [
        m
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ] + [head]
    for i, lin in enumerate(order):
        ahead: list[torch.Tensor] = []
        size = 0
        for nxt in order[i + 1 :] + order[:i]:
            for part in nxt.parts:
                if size < _AHEAD_BYTES:
                    ahead.append(part.blocks)
                    size += part.blocks.numel()
        lin.prefetch_in_order(ahead)


def types_without_kernel(gguf_path: str | Path) -> list[str]:
    """The block types of the file's matrices that no kernel of ours reads (sorted names; empty: the whole model runs
    on its own blocks). The table `radixserve serve` read early is used when there is one; else the one read here is
    left for the load (either way, one header walk)."""
    path = Path(gguf_path)
    table = huge_pages.early_table(path)
    if table is None:
        table = read_tensor_table(path)
        huge_pages.keep_table(path, table)
    return sorted({t.type.name for t in table.tensors.values() if len(t.shape) == 2 and t.type not in KERNEL_TYPES})


def load_gguf_model(gguf_path: str | Path, config: ModelConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model over the file's blocks, activations in `dtype` (float32 or bfloat16); ValueError for a tensor
    whose block type has no kernel."""
    early = huge_pages.take_early(Path(gguf_path))  # `radixserve serve` may have mapped it and started the move
    table = early[0] if early else read_tensor_table(gguf_path)
    tensors = _Tensors(table, config)
    with torch.device("meta"):  # a skeleton: every weight is replaced below
        model = LlamaForCausalLM(config, dtype)
    hidden = config.hidden_size
    for i, layer in enumerate(model.layers):
        for fused, names in _FUSED.items():
            owner_name, _, attr = fused.rpartition(".")
            owner = layer.get_submodule(owner_name)
            in_features = getattr(owner, attr).weight.shape[1]
            setattr(owner, attr, _linear(tensors, i, names, in_features))
    model.embed_tokens = GGUFEmbedding(tensors.part("token_embd.weight"), dtype)  # type: ignore[assignment]
    head = "output.weight" if "output.weight" in tensors.by_name else "token_embd.weight"
    # float32 logits: the kernel rounds its input to int8 either way, so only the output's rounding differs, and
    # bfloat16 logits (8 bits) moved the perplexity by 0.08% against llama-perplexity (RESULTS.md, issue 38 s11).
    lm_head = GGUFLinear([tensors.part(head)], hidden, None, float_output=True)
    if model.lm_head is not None:
        model.lm_head = lm_head  # type: ignore[assignment]
    else:
        model.tied_head = lm_head  # type: ignore[assignment]
    _assign_floats(model, tensors, dtype)
    _prefetch_in_step_order(model, lm_head)
    # The blocks the step reads onto huge pages (radixserve/gguf/huge_pages.py); the embedding stays on the file's
    # pages, where only the rows of tokens seen take memory.
    model.huge_pages = (early[1] if early else None) or huge_pages.start_moving(table)  # type: ignore[assignment]
    c = config
    model.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
    return model
