"""A GGUF's Q4_K tensors re-stored as Q5_K with the same weights: a Q5_K file to test and time the Q5_K kernels on a
real model, whose answers must equal the original's bit for bit.

Why the same bits: a Q4_K super-block (fp16 d, dmin, 6-bit scales sc and minima m, codes q in 0..15) becomes a Q5_K
one with codes 2q (the fifth bit used) and d / 2, the same dmin, sc and m: w = (d / 2) sc (2q) - dmin m is the same
float. Our kernels' integer sums double exactly and their float steps multiply by d / 2 (a power of two: exact), so
every product, sum and logit is unchanged. Where halving d is not exact (a subnormal fp16), the block keeps d and
codes q (fifth bits 0). gguf-py has no K-quant quantizer; this is the one Q5_K file we can make without one.

    .venv/bin/python -m benchmarks.gguf_twin [--source GGUF] [--out GGUF]

Default source: the default model's GGUF in the radixserve cache; default out: beside it, `-q5k-twin.gguf`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

Q4_K_BYTES, Q5_K_BYTES = GGML_QUANT_SIZES[T.Q4_K][1], GGML_QUANT_SIZES[T.Q5_K][1]


def q4_k_as_q5_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 `[rows, n * 144]` Q4_K super-blocks -> `[rows, n * 176]` Q5_K super-blocks of the same weights."""
    rows = blocks.shape[0]
    src = np.ascontiguousarray(blocks).reshape(-1, Q4_K_BYTES)
    d = src[:, 0:2].copy().view(np.float16)[:, 0]
    half = (d / np.float16(2)).astype(np.float16)
    exact = (half.astype(np.float32) * 2 == d.astype(np.float32)) & (np.abs(half) >= np.float16(2.0**-14))
    qs = src[:, 16:].reshape(-1, 4, 32)  # chunk c holds sub-blocks 2c (low nibbles) and 2c + 1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # [n, sub-block, column]
    q = np.where(exact[:, None, None], q * 2, q).astype(np.uint8)
    out = np.empty((src.shape[0], Q5_K_BYTES), dtype=np.uint8)
    out[:, 0:2] = np.where(exact, half, d).astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:16] = src[:, 2:16]  # dmin, the scales and minima
    fifth = (q >> 4) & 1  # sub-block j's fifth bits go to bit j of qh[column]
    out[:, 16:48] = (fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    low = q & 0x0F
    out[:, 48:] = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return out.reshape(rows, -1)


def write_twin(source: Path, out: Path) -> Path:
    """`out`: `source` with every Q4_K tensor stored as Q5_K (q4_k_as_q5_k), all else as it was."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        if kind == T.Q4_K:
            data, kind = q4_k_as_q5_k(data), T.Q5_K
        writer.add_tensor(tensor.name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def main() -> None:
    from radixserve.model.resolve import assemble_default_gguf, default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="a GGUF file (default: the default model's)")
    parser.add_argument("--out", type=Path, help="where to write the twin (default: beside the source)")
    args = parser.parse_args()
    source = args.source or assemble_default_gguf(default_cache_dir())
    out = args.out or source.with_name(source.stem + "-q5k-twin.gguf")
    print(write_twin(source, out))


if __name__ == "__main__":
    main()
