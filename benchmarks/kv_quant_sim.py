"""Which int8 KV scheme keeps the default model's perplexity (issue 40): K and V are fake-quantized as they are
stored (quantized, then dequantized into a float32 pool), so any scheme can be scored without building its layout.

A scheme is `K:V`, each side one of: `none` (bfloat16 values as computed), `gN` (symmetric int8 with one float16
scale per N values of a row: g64 is the shipped format, one scale per token and head), `hN` (the row rotated by the
64 x 64 Hadamard matrix first, then gN; the rotation is orthogonal, so a reader would rotate q instead and the
scores are unchanged, while an outlier channel is spread over the whole row); a trailing `m3` stores each scale in
one byte, rounded up to 3 mantissa bits (a float8 e4m3 scale's precision, without its range limit) instead of
float16; a trailing `l16` stores each scale in one byte as a power of 2^(1/16), rounded up (`SCALES`:
2^(c / 16 - 14) for codes c = 0..255); `l16n`: the nearer of those two scales (the group's largest value
may clip); `u`: a float16 scale rounded up instead of to nearest; `s16` / `s8`: a
float16 scale of the row (rounded up) and a 4-bit code per group, the group's scale 2^(-c / 16) or 2^(-c / 8)
times the row's (64 values and 4 bytes of scales, as l16's width); `s16n` / `s8n`: the same with the row's
scale rounded to nearest; `c`: the scale that minimizes the group's squared error (max |x| / 127 times the best
of 1, 0.99, ..., 0.80: the largest values may clip). The
dequantized rows are stored in float32, as the int8 engine's readers take them. Perplexity as benchmarks/quality.py
measures it, bfloat16 weights, one engine per scheme.

`--engine-space` keeps K and V in the rotated space, as the int8 engine stores them (an `hN` side is quantized
there, any other side quantized as it is, then rotated), and the readers rotate the query and the attention output
with the int8 format's transforms (values by H S: kv_format.VALUE_SIGNS), each rounded to bfloat16, as the
engine's do (without it an `hN` row is rotated back in float32
before it is stored, and the query is not rotated: the same scores up to rounding, a different rounding).
benchmarks/kv_quant_signs.py measures how far the engine's perplexity moves by rounding alone.

    .venv/bin/python -m benchmarks.kv_quant_sim [--schemes none:none g64:g64 none:g64 g64:none g16:g64 h64:g64 ...]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.kv_quant import header  # noqa: E402
from benchmarks.quality import TEXT, perplexity  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.cache.kv_format import KVFormat, flip_value_signs, fwht  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402


def hadamard(n: int) -> torch.Tensor:
    """The n x n Walsh-Hadamard matrix / sqrt(n) (orthonormal; n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def round_up_3_bits(s: torch.Tensor) -> torch.Tensor:
    """Positive float32 s rounded up to 3 mantissa bits (an integer add on the bits: a carry moves the exponent)."""
    bits = s.view(torch.int32)
    return ((bits + (1 << 20) - 1) & ~((1 << 20) - 1)).view(torch.float32)


# One-byte log scales: code c means 2^(c / 16 - 14) (16 steps an octave, 2^-14 .. 2^1.94, so max |x| up to 486
# before values clip; Qwen2.5's scales span about 2^-13.6 .. 2^-0.5 over K and V). Built as the reverted format of
# commit c0cde2c built it (the mantissa from pow, times an exact power of two), which this simulation matched bit
# for bit.
SCALES = torch.tensor([2.0 ** (i / 16) * 2.0 ** (c - 14) for c in range(16) for i in range(16)], dtype=torch.float32)


def round_up_log16(s: torch.Tensor) -> torch.Tensor:
    """Positive float32 s rounded up to the int8 format's one-byte scales (`SCALES`; clamped at both ends)."""
    return SCALES[torch.searchsorted(SCALES, s.contiguous()).clamp(max=len(SCALES) - 1)]


def nearest_log16(s: torch.Tensor) -> torch.Tensor:
    """Positive float32 s rounded to the nearer of the two one-byte scales around it (`SCALES`), so the
    largest value of a group may clip by up to half a step (2.2%)."""
    i = torch.searchsorted(SCALES, s.contiguous()).clamp(1, len(SCALES) - 1)
    lo, hi = SCALES[i - 1], SCALES[i]
    return torch.where(s < (lo + hi) / 2, lo, hi)


def round_up_half(s: torch.Tensor) -> torch.Tensor:
    """Positive float32 s rounded up to float16 (not to nearest, as the float16 scales are)."""
    h = s.half()
    return torch.where(h.float() < s, torch.nextafter(h, torch.tensor(torch.inf, dtype=torch.half)), h).float()


def sub_scales(amax: torch.Tensor, steps: int, nearest: bool) -> torch.Tensor:
    """Group scales `[..., groups, 1]` from max |x| / 127 per group as a float16 scale of the row (its largest
    group's, rounded up, or to nearest) times a 4-bit code per group, 2^(-c / steps) for c = 0..15: the smallest
    not below."""
    row = amax.amax(-2, keepdim=True).contiguous()
    row = row.half().float() if nearest else round_up_half(row)
    c = (-torch.log2(amax.clamp(min=1e-30) / row) * steps).floor().clamp(0, 15)
    return row * torch.exp2(-c / steps)


def mse_scale(groups: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per group, the float16 scale among amax x (1, 0.99, ..., 0.80) whose quantization has the least squared error."""
    best, best_err = None, None
    for f in torch.arange(100, 79, -1) / 100:
        s = (amax * f).half().float()
        q = torch.where(s > 0, groups / s.clamp(min=1e-30), 0.0).round().clamp(-127, 127)
        err = ((q * s - groups) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def fake_quantize(
    x: torch.Tensor, side: str, rot: Callable | None = None, unrot: Callable | None = None
) -> torch.Tensor:
    """x `[..., D]` through one side of a scheme and back, in float32 (what the int8 readers compute in). An `hN`
    side rotates by `rot` (default: the Hadamard matrix) and back by `unrot` (its transpose; None: stays rotated)."""
    if side == "none":
        return x
    kind, group, byte = re.fullmatch(r"([gh])(\d+)(m3|l16n|l16|u|s8n|s16n|s8|s16|c)?", side).groups()
    byte_scale = {"m3": round_up_3_bits, "l16": round_up_log16, "l16n": nearest_log16, "u": round_up_half}.get(byte)
    xf = x.float()
    if kind == "h" and rot is None:
        h = hadamard(x.shape[-1])
        rot, unrot = (lambda y: y @ h), (lambda y: y @ h.T)
    if kind == "h":
        xf = rot(xf)
    groups = xf.reshape(*xf.shape[:-1], -1, int(group))
    amax = groups.abs().amax(-1, keepdim=True) / 127
    if byte == "c":
        scale = mse_scale(groups, amax)
    elif byte and byte[0] == "s":
        scale = sub_scales(amax, int(byte[1:].removesuffix("n")), byte.endswith("n"))
    else:
        scale = byte_scale(amax.contiguous()) if byte_scale else amax.half().float()
    q = torch.where(scale > 0, groups / scale.clamp(min=1e-30), 0.0).round().clamp(-127, 127)
    out = (q * scale).reshape(xf.shape)
    return unrot(out) if kind == "h" and unrot is not None else out


# The int8 format's rotations (KVFormat.rotate, rotate_values and unrotate_values), from the functions they call:
# --engine-space patches them onto the float32 pool's format, so they cannot be the methods themselves.
ROTATIONS = {"k": lambda x: fwht(x.to(torch.float32)), "v": lambda x: fwht(flip_value_signs(x.to(torch.float32)))}


def to_space(x: torch.Tensor, side: str, engine: bool, kind: str) -> torch.Tensor:
    """K (`kind` "k") or V rows through one side, in the space the readers take them: as the model computed them,
    or for `engine` (--engine-space) rotated as the int8 engine stores them."""
    if not engine:
        return fake_quantize(x, side)
    if side.startswith("h"):
        return fake_quantize(x, side, ROTATIONS[kind], None)
    return ROTATIONS[kind](fake_quantize(x, side))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["none:none", "g64:g64", "none:g64", "g64:none", "h64:g64"])
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--text", type=Path, nargs="+", default=[TEXT])
    ap.add_argument("--engine-space", action="store_true", help="K and V kept rotated, as the engine does")
    a = ap.parse_args()
    header()
    text = "\n\n".join(p.read_text() for p in a.text)
    saved = KVPool.store, KVFormat.rotate, KVFormat.unrotate_values, TorchAttentionBackend.use_cpu_kernels
    if a.engine_space:
        # The float32 pool's readers rotate as int8's do; on the SDPA path alone (the C++ op rotates int8 pages only).
        KVFormat.rotate = lambda self, x: ROTATIONS["k"](x)
        KVFormat.unrotate_values = lambda self, x: flip_value_signs(fwht(x.to(torch.float32)))
        TorchAttentionBackend.use_cpu_kernels = False
    print(f"| K:V scheme | perplexity ({a.ppl_tokens} tokens) | vs {a.schemes[0]} |")
    print("|---|---|---|")
    base = None
    try:
        for scheme in a.schemes:
            k_side, v_side = scheme.split(":")

            def fake_store(self, layer, loc, k, v, k_side=k_side, v_side=v_side):  # noqa: ANN001, ANN202
                k, v = to_space(k, k_side, a.engine_space, "k"), to_space(v, v_side, a.engine_space, "v")
                for buf, x in ((self.k_buffers[layer], k), (self.v_buffers[layer], v)):
                    buf.view(-1, *buf.shape[2:]).index_copy_(0, loc, x.to(buf.dtype))

            KVPool.store = fake_store
            t = time.perf_counter()
            kw = {"dtype": "bfloat16", "quantization": "none", "speculative": "off"}
            with Engine(kv_cache_dtype="float32", max_total_tokens=a.ppl_tokens + 512, **kw) as eng:
                ppl = perplexity(eng, eng.tokenizer.encode(text, add_special_tokens=False)[: a.ppl_tokens])
            base = base or ppl
            print(f"| {scheme} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | ({time.perf_counter() - t:.0f} s)")
    finally:
        KVPool.store, KVFormat.rotate, KVFormat.unrotate_values, TorchAttentionBackend.use_cpu_kernels = saved


if __name__ == "__main__":
    main()
