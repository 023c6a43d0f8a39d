"""Linears and the token embedding over a GGUF file's own quantized blocks (issue 38): no float copy, no requantizing.

A GGUFLinear holds, per stacked part (q, k, v of a fused projection may each have their own block type), the part's
blocks as a uint8 `[rows, bytes per row]` view of the file's memory map and its ggml type id; radixserve_kernels/cpu/
gguf_linear.cpp multiplies with them directly (activations rounded to int8 per block of 32, as llama.cpp does; per
256 columns for the K-quants on the AVX2 path, as llama.cpp's K-quant dot products do).
The embedding dequantizes only the looked-up rows. Where the CPU kernels cannot be built, both fall back to
gguf-py's numpy dequantizer (slow, kept for correctness: the float weight is cached on first use).

On a CPU with AMX, calls of `DENSE_ROWS` rows or more (prefill) take radixserve_kernels/cpu/gguf_dense.cpp instead: the
blocks dequantized a chunk at a time into the activations' dtype for oneDNN's tile matmuls, 1.2-3.8x the integer
kernels' speed from 128 to 512 rows there (RESULTS.md, issue 38 session 36). Its sums are not batch-invariant, so
deterministic mode turns it off (radixserve/model/deterministic.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

import radixserve_kernels.cpu as cpu_kernels
from radixserve.model import cpu_select

# The block types radixserve_kernels/cpu/gguf_blocks.h reads.
KERNEL_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the activations gguf_linear.cpp takes
# Rows from which a call takes the dense path on AMX (gguf_dense.cpp, which pads the rows to a multiple of 64).
# Measured on the default model's layer 1, bf16, 2 threads, kernel / dense time (issue 38 session 36): at 64 rows
# gate_up 1.19x, down 1.17x, o 1.55x, qkv 0.73x; at 128 1.24-1.96x; at 256 1.86-2.86x.
DENSE_ROWS = 64


def dense_rows_default() -> int | None:
    """Rows from which GGUFLinear runs the dense path, None for never: DENSE_ROWS on a CPU with AMX.
    RADIXSERVE_GGUF_DENSE_ROWS overrides it (0: never), so tests and benchmarks can run either path on any CPU."""
    env = os.environ.get("RADIXSERVE_GGUF_DENSE_ROWS")
    if env is not None:
        return int(env) or None
    return DENSE_ROWS if cpu_select.cpu_kind() == "AMX" else None


@dataclass(frozen=True)
class BlockPart:
    """One tensor's rows as stored in the GGUF: uint8 `[rows, bytes]` and its ggml type."""

    blocks: torch.Tensor
    type: GGMLQuantizationType

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, K]` by gguf-py (the reference the kernel tests compare with)."""
        return torch.from_numpy(np.asarray(quants.dequantize(self.blocks.numpy(), self.type), dtype=np.float32))


class GGUFLinear(nn.Module):
    """y = x W^T + b with W the stacked parts' blocks; returns the activations' dtype (float32 or bfloat16), or
    float32 with `float_output` (the LM head: bfloat16 input is widened exactly, and the kernel rounds it to int8
    the same way from either)."""

    def __init__(
        self, parts: list[BlockPart], in_features: int, bias: torch.Tensor | None, float_output: bool = False
    ) -> None:
        super().__init__()
        unsupported = sorted({p.type.name for p in parts if p.type not in KERNEL_TYPES})
        if unsupported:
            raise ValueError(
                f"GGUF block types {', '.join(unsupported)} have no kernel (see gguf_blocks.h): "
                "serve this file with --quantization int8 (re-quantized) or none"
            )
        self.parts = parts
        self.in_features, self.out_features = in_features, sum(p.rows for p in parts)
        self._blocks = [p.blocks for p in parts]
        for i, p in enumerate(parts):  # buffers (not saved): what the model holds shows in model.buffers()
            self.register_buffer(f"blocks{i}", p.blocks, persistent=False)
        self._types = [int(p.type) for p in parts]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self._dense: torch.Tensor | None = None
        self.float_output = float_output
        self._ahead: list[torch.Tensor] | None = None  # see prefetch_in_order
        # Not the LM head: its dense copy of a prefill's logits rows would dequantize 152k rows for a few.
        self.dense_rows = None if float_output else dense_rows_default()

    def prefetch_in_order(self, ahead: list[torch.Tensor]) -> None:
        """After each call, have the kernels' thread pool prefetch `ahead` (the blocks the next linears of a step
        read, in order; the kernel takes their first few MB) while the caller does the serial work between the two
        (radixserve_kernels/cpu/spin_pool.h, prefetch_ahead)."""
        self._ahead = ahead or None

    @property
    def row_invariant(self) -> bool:
        """A row's result does not depend on the call's other rows: true of our kernels
        (radixserve_kernels/cpu/gguf_tiles.h), not of a dense matmul (the fallback's, or gguf_dense.cpp's from
        `dense_rows` rows)."""
        return cpu_kernels.ops() is not None and self.dense_rows is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels.ops()
        if ops is not None and x.dim() == 2 and not self.float_output and x.dtype in _KERNEL_DTYPES:
            # The layers' case, ~100 calls a decode step: straight to the op, without the reshapes below.
            return self._kernel(ops, x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.float_output:
            x2 = x2.float()
        if ops is not None and x.dtype in _KERNEL_DTYPES:
            y = self._kernel(ops, x2)
        else:
            if self._dense is None:
                self._dense = torch.cat([p.dequantize() for p in self.parts])
            y = x2.float() @ self._dense.T
            y = (y if self.bias is None else y + self.bias).to(x2.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel(self, ops: object, x: torch.Tensor) -> torch.Tensor:
        if self.dense_rows is not None and x.shape[0] >= self.dense_rows:
            return ops.gguf_linear_dense(x, self._blocks, self._types, self.bias)
        return ops.gguf_linear(x, self._blocks, self._types, self.bias, self._ahead)

    def extra_repr(self) -> str:
        types = "+".join(p.type.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={types}"


class GGUFEmbedding(nn.Module):
    """Token rows dequantized from the GGUF's blocks on lookup, in `dtype`."""

    def __init__(self, part: BlockPart, dtype: torch.dtype) -> None:
        super().__init__()
        if part.type not in KERNEL_TYPES:
            raise ValueError(f"GGUF block type {part.type.name} has no kernel (see gguf_blocks.h)")
        self.part, self.dtype = part, dtype
        self.num_embeddings = part.rows
        self.register_buffer("blocks", part.blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        ops = cpu_kernels.ops()
        if ops is not None:
            rows = ops.gguf_dequantize(self.part.blocks, int(self.part.type), flat)
        else:
            rows = BlockPart(self.part.blocks[flat], self.part.type).dequantize()
        return rows.to(self.dtype).reshape(*ids.shape, -1)
