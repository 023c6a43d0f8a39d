"""Pick the activation dtype and weight format for `dtype="auto"` / `quantization="auto"` from the CPU's kind.

The kinds, widest first: AMX (amx_bf16 tiles), AVX512_BF16 (avx512_bf16 instructions), AVX512, AVX2. Why they
differ: bf16 matmuls only have a hardware path on AVX512_BF16 and AMX; on AVX2/AVX512 torch emulates them (a 96-token
prefill matmul measured 5x slower than float32 on the issue's AVX2 EPYC), so activations stay float32 there.

Weight format (only when dtype is "auto" too; an explicit dtype means no quantization unless one is asked for),
chosen by one rule: of the formats whose perplexity stays within 2% of float32 on the default model
(benchmarks/quality.py: bf16 +0.0%, int8 +0.3%, int4 +10.5%), the one that decodes fastest without making batched
decode or prefill slower. On AMX (benchmarks/quant_engine.py, RESULTS.md) int8 alone decoded 1.2-1.7x faster than
packed bf16 at 1 stream on the loaded shared machine but lost at 8 streams (0.4-0.8x) and at prefill; int8 with its
codes also packed in bf16 (Int8Linear.keep_dense_copy: same weights, bf16 kernels for 2+ rows) decoded 1.07x (idle
machine) to 1.35x (loaded) faster at 1 stream, 0.96-1.05x at 8 streams, prefill within noise of bf16, for 1.4x
bf16's weight memory. int4 decodes fastest (1.7-3.3x) but prefills 4-7x slower and fails the perplexity bar, so
it stays an explicit choice. AVX512_BF16 gets AMX's choice, measured per linear on an AMD EPYC (Zen 4, no AMX;
RESULTS.md, issue 14 third pass): the int8 op 1.15-1.5x faster than packed bf16 at 1 row, a tie at 2, packed bf16
1.5-1.8x faster at 8 rows and more at 96, float32 2-6x slower than bf16 throughout.
AVX2/AVX512 keep float32 and no quantization: the int8 op needs bf16 activations, emulated there, and no
engine-level run on such a CPU has measured int8 yet (the issue's figures are per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZATIONS = ("auto", "none", "int8", "int4")
CPU_KINDS = ("AMX", "AVX512_BF16", "AVX512", "AVX2", "DEFAULT")

# kind -> (dtype, quantization, keep a bf16 copy of the int8 codes, why): the table `choose` reads for "auto".
CHOICES: dict[str, tuple[str, str, bool, str]] = {
    "AMX": (
        "bfloat16",
        "int8",
        True,
        "bf16 on AMX tiles; int8 weights for 1-row decode steps (half the bytes of "
        "bf16: 1.07-1.35x faster measured), the same codes packed in bf16 for batched "
        "decode and prefill (bf16 speed, 1.4x bf16's weight memory); int4 misses the "
        "2% perplexity bar",
    ),
    "AVX512_BF16": (
        "bfloat16",
        "int8",
        True,
        "native bf16; int8 weights for 1-row decode steps, the same codes "
        "packed in bf16 for batched decode and prefill",
    ),
    "AVX512": ("float32", "none", False, "no bf16 hardware: float32 activations (bf16 would be emulated)"),
    "AVX2": (
        "float32",
        "none",
        False,
        "no bf16 hardware: float32 activations (bf16 would be emulated, 5x slower prefill)",
    ),
    "DEFAULT": ("float32", "none", False, "no SIMD path torch knows: float32"),
}


@dataclass(frozen=True)
class CpuChoice:
    dtype: str  # float32 | bfloat16 | float16
    quantization: str  # none | int8 | int4
    reason: str
    dense_copy: bool = False  # int8 codes also kept packed in bf16 for steps of 2+ rows (Int8Linear.keep_dense_copy)

    @property
    def weights(self) -> str:
        """What the loader builds: none, int8, int4, or int8+bf16."""
        return f"{self.quantization}+bf16" if self.dense_copy else self.quantization


def cpu_capability() -> str:
    """torch's name for the widest SIMD it dispatches to here: DEFAULT, AVX2, AVX512 (monkeypatched in tests)."""
    return torch.backends.cpu.get_cpu_capability()


def has_bf16_hardware() -> bool:
    """AVX-512-BF16 or AMX: oneDNN then has native bf16 kernels (monkeypatched in tests)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def has_amx() -> bool:
    """AMX tiles with bf16 (Sapphire Rapids and later), as torch detects them (monkeypatched in tests)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_tile") and caps.get("amx_bf16"))


def cpu_kind() -> str:
    """One of CPU_KINDS for this machine."""
    cap = cpu_capability()
    if has_bf16_hardware():
        return "AMX" if has_amx() else "AVX512_BF16"
    return cap if cap in ("AVX512", "AVX2") else "DEFAULT"


def choose(dtype: str, quantization: str, device_type: str = "cpu") -> CpuChoice:
    """Resolve "auto" in either argument; an explicit value is kept. ValueError for an unknown quantization."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device_type != "cpu":
        if quantization in ("int8", "int4"):
            raise ValueError(
                f"quantization={quantization!r} is a CPU path (torch's packed CPU ops); use 'none' on GPUs"
            )
        return CpuChoice(
            "bfloat16" if dtype == "auto" else dtype, "none", f"{device_type}: bf16, no weight quantization"
        )
    kind = cpu_kind()
    auto_dtype, auto_quant, dense_copy, why = CHOICES[kind]
    parts = [f"cpu={kind}"]
    if dtype == "auto":
        parts.append(why)
    if quantization == "auto" and dtype != "auto":
        # An explicit dtype asks for that dtype's numerics (the float32 parity tests rely on it): no quantization.
        auto_quant = "none"
        parts.append(f"explicit dtype={dtype}, so no weight quantization unless asked")
    elif dtype != "auto" or quantization != "auto":
        parts.append(
            "explicit "
            + ", ".join(f"{k}={v}" for k, v in (("dtype", dtype), ("quantization", quantization)) if v != "auto")
        )
    return CpuChoice(
        auto_dtype if dtype == "auto" else dtype,
        auto_quant if quantization == "auto" else quantization,
        "; ".join(parts),
        dense_copy=dense_copy and dtype == "auto" and quantization == "auto",
    )
