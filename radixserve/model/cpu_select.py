"""Pick the activation dtype and weight format for `dtype="auto"` / `quantization="auto"` from the CPU's kind.

The kinds, widest first: AMX (amx_bf16 tiles), AVX512_BF16 (avx512_bf16 instructions), AVX512, AVX2. Why they
differ: bf16 matmuls only have a hardware path on AVX512_BF16 and AMX; on AVX2/AVX512 torch emulates them (a 96-token
prefill matmul measured 5x slower than float32 on the issue's AVX2 EPYC), so activations stay float32 there.

Weight format (only when dtype is "auto" too; an explicit dtype means no quantization unless one is asked for),
chosen by one rule: of the formats whose perplexity stays within 2% of float32 on the default model
(benchmarks/quality.py: bf16 +0.0%, int8 +0.3%, int4 +10.5%), the one that decodes fastest without making batched
decode or prefill much slower. int8 on every x86 kind: steps of fewer than 48 rows (decode, batched decode,
speculative verify) run our kernel (radixserve_kernels/cpu/int8_linear.cpp: AVX-512 VNNI, else AVX2 FMA), which reads
the int8 codes once per step at close to the memory bandwidth, half of bf16's bytes and a quarter of float32's;
larger steps widen the codes a cache-sized slice at a time for the dense matmul in the activations' dtype
(RESULTS.md, issue 14 fourth pass), except in deterministic mode (radixserve/model/deterministic.py; on by default
on AVX512_BF16), where every step runs the kernel's one batch-invariant path. int4 decodes from fewer bytes but
fails the perplexity bar, so it stays an explicit choice. A GGUF model (the default one is) runs the file's own
blocks where the table says int8 (GGUF_AUTO). Activations: bf16 where the CPU has bf16 hardware (AMX, AVX512_BF16),
float32 elsewhere. KV pages (kv_cache_dtype "auto"): the activations' dtype, except bfloat16 where "auto" chose
float32 activations: pages are stored and read, never multiplied by oneDNN, so bf16's missing hardware costs nothing
there (a shift widens a value; the CPU decode op and store_kv take float32 rows with bfloat16 pages) and the pool
takes half of float32's memory, as llama.cpp's float16 KV cache does (RESULTS.md, issue 38 session 20).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
CPU_KINDS = ("AMX", "AVX512_BF16", "AVX512", "AVX2", "DEFAULT")

# kind -> (dtype, quantization, why that dtype, why those weights): the table `choose` reads for "auto".
CHOICES: dict[str, tuple[str, str, str, str]] = {
    "AMX": (
        "bfloat16",
        "int8",
        "bf16 on AMX tiles for prefill",
        "int8 weights read by our kernel for decode steps (half of bf16's bytes)",
    ),
    "AVX512_BF16": (
        "bfloat16",
        "int8",
        "native bf16 for prefill",
        "int8 weights read by our VNNI kernel for decode steps (half of bf16's bytes)",
    ),
    "AVX512": (
        "float32",
        "int8",
        "no bf16 hardware: float32 activations (bf16 would be emulated)",
        "int8 weights for decode (a quarter of float32's bytes)",
    ),
    "AVX2": (
        "float32",
        "int8",
        "no bf16 hardware: float32 activations (bf16 would be emulated, 5x slower prefill)",
        "int8 weights read by our AVX2 kernel for decode (a quarter of float32's bytes)",
    ),
    "DEFAULT": ("float32", "none", "no SIMD path torch knows: float32", "no weight quantization"),
}


# What quantization="auto" runs on a model whose weights are a GGUF file, where the kind's table asks for int8:
# "gguf" multiplies with the file's own blocks (issue 38: nothing dequantized or prepared, the file is all the disk
# it takes, 0.79x int8's bytes per decode step); "int8" re-quantizes them per output channel (a 768 MB prepared copy
# beside the file, built at the first start). The blocks decode one stream 1.4-1.7x faster than int8 and use less
# memory; on AVX-512 VNNI they are level with int8 or ahead where a step is compute-bound too (eight streams 1.06-1.33x,
# prefill 1.00-1.08x, multi-turn TTFT p50 0.89-1.05x int8's; RESULTS.md, issue 38 session 17). On AVX2 int8 led at
# prefill in session 16 (the blocks 0.78x int8's); the AVX2 tiles have since run 1.2-1.4x faster (session 18), not
# yet measured against int8 through the server. --quantization int8 still gives int8. A GGUF with a matrix of a block
# type we have no kernel for (Q3_K, IQ*, F16 ...) is not a "GGUF model" here: auto re-quantizes it (Engine).
GGUF_AUTO = "gguf"


def auto_weight_format(table_format: str, gguf_model: bool) -> tuple[str, str]:
    """The weight format "auto" means, from the CPU kind's table entry and whether the weights are a GGUF file:
    (format, why). A Hugging Face checkpoint keeps the table's format."""
    if not gguf_model or table_format != "int8":
        return table_format, ""
    if GGUF_AUTO == "gguf":
        return "gguf", "a GGUF model: its own blocks, as stored"
    return GGUF_AUTO, f"a GGUF model: its blocks re-quantized to {GGUF_AUTO} (radixserve/model/cpu_select.GGUF_AUTO)"


@dataclass(frozen=True)
class CpuChoice:
    dtype: str  # float32 | bfloat16 | float16
    quantization: str  # none | int8 | int4 | gguf
    reason: str
    auto_kv_pages: str = ""  # what kv_cache_dtype "auto" stores; "" means dtype

    def kv_pages(self, kv_cache_dtype: str) -> str:
        """kv_cache_dtype with "auto" resolved (radixserve/cache/kv_format.py's names)."""
        return kv_cache_dtype if kv_cache_dtype != "auto" else self.auto_kv_pages or self.dtype


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


def choose(dtype: str, quantization: str, device_type: str = "cpu", gguf_model: bool = False) -> CpuChoice:
    """Resolve "auto" in either argument; an explicit value is kept. ValueError for an unknown quantization.
    gguf_model: the weights are a GGUF file's (`auto_weight_format`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device_type != "cpu":
        if quantization in ("int8", "int4", "gguf"):
            raise ValueError(
                f"quantization={quantization!r} is a CPU path (torch's packed CPU ops); use 'none' on GPUs"
            )
        return CpuChoice(
            "bfloat16" if dtype == "auto" else dtype, "none", f"{device_type}: bf16, no weight quantization"
        )
    kind = cpu_kind()
    auto_dtype, auto_quant, why_dtype, why_weights = CHOICES[kind]
    parts = [f"cpu={kind}"]
    if dtype == "auto":
        parts.append(why_dtype)
    if quantization == "auto" and dtype != "auto":
        # An explicit dtype asks for that dtype's numerics (the float32 parity tests rely on it): no quantization.
        auto_quant = "none"
        parts.append(f"explicit dtype={dtype}, so no weight quantization unless asked")
    elif dtype != "auto" or quantization != "auto":
        parts.append(
            "explicit "
            + ", ".join(f"{k}={v}" for k, v in (("dtype", dtype), ("quantization", quantization)) if v != "auto")
        )
    else:
        auto_quant, why_format = auto_weight_format(auto_quant, gguf_model)
        parts.append(why_format or why_weights)  # a GGUF's own blocks replace the table's weights, and its reason
    # float32 chosen for the matmuls alone: the KV pages need no bf16 hardware (module docstring).
    kv_pages = "bfloat16" if dtype == "auto" and auto_dtype == "float32" else ""
    parts += ["bfloat16 KV pages (half of float32's memory)"] if kv_pages else []
    return CpuChoice(
        auto_dtype if dtype == "auto" else dtype,
        auto_quant if quantization == "auto" else quantization,
        "; ".join(parts),
        kv_pages,
    )
