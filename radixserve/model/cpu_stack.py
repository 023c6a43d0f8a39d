"""A GGUF model's decoder layers as one C++ call a step on CPU (radixserve_kernels/cpu/decoder_stack.cpp; issue 38).

In Python a layer is ~15 op dispatches plus the module calls around them: ~2 ms of a ~13 ms decode step of the
default model, serial, while the kernels' second thread waits. The stack runs the same ops (the functions
torch.ops.radixserve dispatches to) in the same order, so its output is the Python path's bit for bit; it serves
only the steps the Python path would run through exactly those ops, and returns None for every other step:

- every layer's four linears over the file's blocks (GGUFLinear), no QK norm (Qwen3), norms in the activations'
  dtype (float32 or bfloat16);
- rotary embedding by table (`RopeStep.cos`/`sin`, not the CUDA kernel);
- attention where every token is a row of the CPU decode op and K/V are stored by a C++ op (`decode_op_step`):
  decode steps, and every step in deterministic mode.

`RADIXSERVE_CPU_STACK=0` (or `ENABLED = False`) turns it off: the benchmarks and tests compare the two paths.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import radixserve_kernels.cpu as cpu_kernels
from radixserve.attention.base import AttentionBackend
from radixserve.model.gguf_linear import GGUFLinear
from radixserve.model.rope import RopeStep

ENABLED = os.environ.get("RADIXSERVE_CPU_STACK", "1") != "0"
_DTYPES = (torch.float32, torch.bfloat16)


def build_stack(model: Any) -> Any | None:
    """`torch.classes.radixserve.DecoderStack` over the model's layers, or None where some layer does not qualify
    (see the module docstring) or the CPU kernels are not built."""
    if cpu_kernels.ops() is None:
        return None
    layers, norm = model.layers, model.norm
    dtype = norm.weight.dtype
    for layer in layers:
        attn = layer.self_attn
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if attn.q_norm is not None or any(type(m) is not GGUFLinear or m.float_output for m in linears):
            return None
        if dtype not in _DTYPES or any(n.weight.dtype != dtype or n.eps != norm.eps for n in norms):
            return None
    first = layers[0].self_attn
    stack = torch.classes.radixserve.DecoderStack(
        first.num_heads, first.num_kv_heads, first.head_dim, norm.eps, norm.weight.detach()
    )
    for layer in layers:
        attn = layer.self_attn
        stack.add_layer(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), attn.k_center
        )
        for lin in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            bias = None if lin.bias is None else lin.bias.detach()
            stack.add_linear(lin._blocks, lin._types, bias, lin._ahead or [])
    return stack


def run_stack(
    stack: Any, h: torch.Tensor, rope: RopeStep, attn: AttentionBackend, dtype: torch.dtype
) -> torch.Tensor | None:
    """The final norm's output for embedded tokens `h`, or None where this step takes the Python path (`dtype`: the
    stack's norms')."""
    if not ENABLED or h.dim() != 2 or h.dtype != dtype or rope.cos is None or rope.sin is None:
        return None
    if rope.fused is not None or rope.cos.dtype != h.dtype:
        return None
    step = attn.decode_op_step(h.dtype)
    if step is None:
        return None
    return stack.run(
        h,
        rope.cos,
        rope.sin,
        step.k_buffers,
        step.v_buffers,
        step.out_cache_loc,
        step.table,
        step.seq_lens,
        step.scale,
        step.int8,
    )
