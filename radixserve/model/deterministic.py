"""Deterministic mode (`--deterministic`, issue 39): a request's tokens and logprobs do not depend on what else the
engine does: cache hits or misses, partial-page copies, the other requests in the step, the chunked-prefill size,
or speculation.

Why they can otherwise: a row's floating-point sums depend on the step's shape. The int8 linears take one path for
1-2 rows (float activations), another for 3-47 (int8 activations, VNNI) and a third, the dense matmul, from 48 rows
on; attention over a prompt runs SDPA per chunk (its reductions split by the chunk's length) while a decode token
runs our paged kernel. In this mode every step runs one path per operation, chosen so that each row's arithmetic
is a function of that row alone:

- linears: radixserve_kernels/cpu/int8_linear.cpp's batch-invariant path for any number of rows (each row quantized
  alone, each output's dot product added in K order; tiles and threads only decide which row and block run when);
- attention: every query row, prompt or decode, goes through radixserve_kernels/cpu/decode_attention.cpp as a row of its
  own over keys 0 .. its position, read in place from the pool's pages (whether cached or just written), in key order;
  with `--attention-backend triton` (on CPU under the Triton interpreter) through the extend kernel's
  batch-invariant variant, the same for prompt and decode rows: keys from the pages in blocks at fixed positions
  (radixserve_kernels/extend_attention.py);
- norms and rotary embedding: already per row (radixserve_kernels/cpu/norm_rope.cpp), as are the elementwise ops and the
  sampler (radixserve/sampling/sampler.py: seeded rows draw from their own generator and never draft).

On by default (`on_by_default`) only on the CPU kind where its cost was measured and found to be none
(benchmarks/RESULTS.md, issue 39: AVX-512 BF16 without AMX, where the batch-invariant VNNI path replaces a bf16
dense prefill of about its speed). On AVX2 the invariant path is the kernel's float FMA one, and prefill lost
56-63% (measured with AVX2 emulated on the AVX-512 machine): a flag there. With AMX tiles the dense prefill it
replaces is much faster: a flag there too (issue 38 session 36: a 512-row call of a GGUF linear 2.4-3.8x faster
through oneDNN's tile matmul, radixserve_kernels/cpu/gguf_dense.cpp, than through the integer kernels, which this mode
keeps).

Hence the conditions `refusal` checks: the CPU kernels built, int8 weights or a GGUF's own blocks (whose kernels
run one path for any number of rows; the dense float matmul is oneDNN's, whose blocking we do not control), the
torch or triton attention backend on CPU, and one rank (tensor parallelism's all-reduce adds partial sums in rank
order). Not on CUDA: there the linears are cuBLAS matmuls,
whose kernel and split-K follow the row count, and we have no batch-invariant matmul for them; FlashInfer's
deterministic settings would fix its attention only (docs/DESIGN.md rule 16).
"""

from __future__ import annotations

from torch import nn

import radixserve_kernels.cpu as cpu_kernels
from radixserve.attention.base import AttentionBackend
from radixserve.model import cpu_select
from radixserve.model.gguf_linear import GGUFLinear
from radixserve.model.llama import Linear
from radixserve.model.quant import Int4Linear, Int8Linear


BACKENDS = ("torch", "triton")  # the attention backends with a batch-invariant path
CPU_OP_KV_DTYPES = ("float32", "bfloat16", "int8")  # the KV pages the CPU decode op reads


def refusal(device_type: str, attention_backend: str, quantization: str, tp: int, kv_pages: str) -> str | None:
    """Why deterministic mode cannot run with these settings (`kv_pages`: the KV format resolved, never "auto"), or
    None when it can."""
    if device_type != "cpu":
        return f"deterministic mode runs on CPU only (device {device_type!r}: no batch-invariant GPU kernels yet)"
    if attention_backend not in BACKENDS:
        return f"deterministic mode needs the torch or triton attention backend, not {attention_backend!r}"
    if attention_backend == "torch" and kv_pages not in CPU_OP_KV_DTYPES:
        # its batch-invariant attention is the C++ decode op, one row per token, which reads only these pages
        return (
            f"deterministic mode on the torch backend needs KV pages the CPU decode op reads "
            f"({', '.join(CPU_OP_KV_DTYPES)}), not {kv_pages!r}"
        )
    if quantization not in ("int8", "gguf"):
        return (
            f"deterministic mode needs int8 weights (quantization 'auto' or 'int8') or a GGUF's own blocks "
            f"('gguf'), not {quantization!r}: only those kernels have a batch-invariant path"
        )
    if tp != 1:
        return "deterministic mode runs on one rank (tp 1)"
    if cpu_kernels.ops() is None:
        return (
            "deterministic mode needs the CPU kernels (radixserve_kernels/cpu; RADIXSERVE_CPU_KERNELS=0 or no compiler)"
        )
    return None


def on_by_default(device_type: str) -> bool:
    """Whether an engine that leaves `deterministic` unset runs it (where `refusal` allows): see the module."""
    return device_type == "cpu" and cpu_select.cpu_kind() == "AVX512_BF16"


def make_deterministic(model: nn.Module, attn: AttentionBackend) -> int:
    """Switch every int8 linear and the attention backend to their batch-invariant paths; returns how many linears.
    ValueError if a linear of another kind is left (it would break the guarantee silently)."""
    if not attn.batch_invariant_path:
        raise ValueError(f"deterministic mode needs the torch or triton attention backend, not {type(attn).__name__}")
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear):
            module.batch_invariant = True
            count += 1
        elif isinstance(module, GGUFLinear):
            module.dense_rows = None  # the integer kernels' one path for any number of rows (gguf_linear.cpp)
            count += 1
        elif isinstance(module, (Int4Linear, Linear, nn.Linear)):
            raise ValueError(
                f"deterministic mode needs every linear in int8 or GGUF blocks; {name} is a {type(module).__name__}"
            )
    attn.deterministic = True
    return count
