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
    """Warps per attention program. With 4 warps the head_dim-128 kernels hit sm_90's 255-register cap and spill
    (bf16 decode 136 B of stack, extend 24 B, float32 extend 2 KB); 8 warps spread the accumulators (no spill)."""
    return 8 if head_dim >= 128 or dtype == torch.float32 else 4
