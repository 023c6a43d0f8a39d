"""Pick the activation dtype and weight quantization for `dtype="auto"` / `quantization="auto"` from the CPU.

Why: bf16 matmuls only have a hardware path on AVX-512-BF16 / AMX CPUs; on AVX2-only CPUs torch emulates them
(a 96-token prefill matmul measured 5x slower than float32 there). Int8 weights (`--quantization int8`,
torch._weight_int8pack_mm) trade prefill for decode: on AVX-512-BF16 (RESULTS.md, benchmarks/quant_engine.py)
bf16+int8 decoded 1.7x faster at 1 stream than packed bf16 but took 1.8x longer on a 1,000-token prefill (the op
is 1.7-5x slower than oneDNN at 96 rows), so "auto" does not pick it; on AVX2 its 96-row cost is unmeasured, so
"auto" keeps float32 there until a run on such a CPU says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class CpuChoice:
    dtype: str  # float32 | bfloat16 | float16
    quantization: str  # none | int8 | int4
    reason: str


def cpu_capability() -> str:
    """torch's name for the widest SIMD it dispatches to here: DEFAULT, AVX2, AVX512 (monkeypatched in tests)."""
    return torch.backends.cpu.get_cpu_capability()


def has_bf16_hardware() -> bool:
    """AVX-512-BF16 or AMX: oneDNN then has native bf16 kernels (monkeypatched in tests)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose(dtype: str, quantization: str, device_type: str = "cpu") -> CpuChoice:
    """Resolve "auto" in either argument; an explicit value is kept. ValueError for an unknown quantization."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device_type != "cpu":
        if quantization in ("int8", "int4"):
            raise ValueError(f"quantization={quantization!r} is a CPU path (torch's packed CPU ops); use 'none' on GPUs")
        return CpuChoice("bfloat16" if dtype == "auto" else dtype, "none", f"{device_type}: bf16, no weight quantization")
    cap, bf16 = cpu_capability(), has_bf16_hardware()
    why = [f"cpu={cap}", f"bf16_hw={'yes' if bf16 else 'no'}"]
    if dtype == "auto":
        dtype = "bfloat16" if bf16 else "float32"
        why.append("bf16 activations (native)" if bf16 else "float32 activations (bf16 would be emulated)")
    if quantization == "auto":
        quantization = "none"
        why.append("no weight quantization (int8 speeds decode but slows prefill, see module doc)")
    return CpuChoice(dtype, quantization, "; ".join(why))
