"""Launch helpers shared by the kernels: interpreter detection and block sizes."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on the CPU through numpy)."""
    return isinstance(kernel, InterpretedFunction)


def needs_upcast(kernel: object, dtype: torch.dtype) -> bool:
    """The interpreter computes bf16 arithmetic on raw bits, so interpreted kernels must cast bf16 loads to float32."""
    return is_interpreted(kernel) and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands must not be rounded to tf32, or the kernels would not match the float32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int, at_least: int = 16) -> int:
    """Smallest power of two >= max(n, at_least): block sizes must be powers of two and tl.dot needs >= 16."""
    n = max(n, at_least)
    return 1 << (n - 1).bit_length()


def attention_num_warps(head_dim: int, dtype: torch.dtype) -> int:
    """Warps per attention program, so that no kernel spills on sm_90 (tests/test_kernels.py checks the cubins).

    With 4 warps the head_dim-128 kernels hit the 255-register cap and spill (bf16 decode: a 136 B stack); 8 warps
    spread the accumulators. (16 would not help: the cap per thread halves to 128.)"""
    return 8 if head_dim >= 128 or dtype == torch.float32 else 4


def wide_fp32(head_dim: int, dtype: torch.dtype) -> bool:
    """float32 at head_dim >= 128: tiles twice as wide in registers, which still spill at 8 warps with the
    16-bit tile sizes; these kernels take smaller key blocks (and extend fewer rows) instead."""
    return dtype == torch.float32 and head_dim >= 128


def decode_block_n(head_dim: int, dtype: torch.dtype, scaled: bool = False) -> int:
    """Keys per block of the decode kernel. int8 pages (`scaled`) are widened to float32 with their scales, which at
    head_dim 128 took the 64-key tiles past the register cap on sm_90 (a 16-24 B stack): they take 32 keys too."""
    return 32 if wide_fp32(head_dim, dtype) or (scaled and head_dim >= 128) else 64


def extend_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, keys) per block of the extend kernel."""
    return (32, 16) if wide_fp32(head_dim, dtype) else (64, 32)
