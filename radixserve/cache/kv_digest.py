"""The identity of a KV page's bytes: which model, dtype, quantization, page size, KV layout and KV page format
computed them.

Pages on disk live under a folder named by this digest and carry it in every file header, so a different model (or
the same model in another dtype, quantization, page size, layout or KV format: int8 pages never feed a bfloat16
pool, nor the reverse) can never read them. The model's identity is its
config plus samples of its weight files (name, size, header and 16 spread slices of each): reading a few MB instead
of hashing gigabytes, yet two checkpoints with the same config and different weights (fine-tunes, random test
models) differ in the samples.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
# Bump when the page file layout or what a page holds changes (3: the KV format, kv_dtype; 4: K and V rows side by
# side with their own widths, int8 value rows of one scale; 5: int8 value rows stored rotated, as the keys; 6: int8
# keys stored centered by the k bias, radixserve/model/key_center.py).
FORMAT_VERSION = 6


@dataclass(frozen=True)
class KVLayout:
    """What one page holds: for `num_layers` layers, `[page_size, num_kv_heads, key_width + value_width]` of `dtype`
    elements, each KV head's key row then its value row, in KV format `kv_dtype` (radixserve/cache/kv_format.py: a
    width is head_dim, or for int8 head_dim and the bytes of the scales each row carries, which differ for K and V).
    Both widths are in the digest, so pages of another row layout are never read."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the stored elements, e.g. "bfloat16", "int8"
    itemsize: int
    kv_dtype: str  # the KV format's name: part of the digest, so a tier is only ever read in its own format
    key_width: int
    value_width: int
    # The dtype the model computed K and V in: bfloat16 pages under float32 activations (a CPU without bf16
    # hardware) hold other bytes than under bfloat16 ones, in the same layout.
    activations: str

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """[layer, token, kv head, stored key row then value row] of one page's payload."""
        return (self.num_layers, self.page_size, self.num_kv_heads, self.key_width + self.value_width)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * self.itemsize


def _file_sample(path: Path) -> bytes:
    size = path.stat().st_size
    out = [path.name.encode(), size.to_bytes(8, "little")]
    with path.open("rb") as f:
        step = max(size // _SAMPLES, 1)
        for i in range(_SAMPLES):
            f.seek(min(i * step, max(size - _SAMPLE_BYTES, 0)))
            out.append(f.read(_SAMPLE_BYTES))
    return b"".join(out)


def model_identity(model_path: str | Path) -> bytes:
    """Bytes that change whenever the model's weights or config do (see the module docstring)."""
    p = Path(model_path)
    files = (
        [p]
        if p.is_file()
        else sorted(f for f in p.iterdir() if f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json")
    )
    return b"".join(_file_sample(f) for f in files)


def kv_digest(model_path: str | Path, quantization: str, layout: KVLayout) -> str:
    """32 hex digits naming everything that decides a page's KV bytes."""
    h = xxhash.xxh3_128()
    h.update(f"radixserve-kv-v{FORMAT_VERSION}".encode())
    h.update(json.dumps({"quantization": quantization, **asdict(layout)}, sort_keys=True).encode())
    h.update(model_identity(model_path))
    return h.hexdigest()
