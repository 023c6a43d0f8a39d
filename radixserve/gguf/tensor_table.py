"""A GGUF file's tensor table and architecture without gguf-py's full parse: what loading its blocks needs.

Why: gguf.GGUFReader builds numpy views of every metadata item, including the 150k-entry vocabulary and merges, which
took 10-50 s on the default model (a busy 2-core machine); loading the tensors needs only their names, types, shapes
and offsets. This walks the header once with `struct`, skipping values it does not need, and maps the data
read-only. Layout (ggml's gguf.md): magic, version, tensor count, metadata count; metadata key-value pairs; tensor
infos (name, dims innermost first, type, offset); then the data, aligned to `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types: fixed sizes in bytes; 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class TableTensor:
    """One tensor: `data` is its bytes in the read-only map (uint8), `shape` PyTorch's order (outermost first)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class TensorTable:
    architecture: str
    tensors: dict[str, TableTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            (n,) = self.take("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.take("<IQ")
            if etype in _FIXED:
                self.pos += _FIXED[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_tensor_table(path: str | Path) -> TensorTable:
    """The architecture and tensors of a GGUF file; ValueError if it is not a GGUF file this reader understands."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    try:
        magic, version, n_tensors, n_kv = cur.take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        architecture, alignment = "", 32
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.take("<I")
            if key == "general.architecture" and vtype == _STRING:
                architecture = cur.string()
            elif key == "general.alignment" and vtype == _UINT32:
                (alignment,) = cur.take("<I")
            else:
                cur.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.take("<I")
            dims = cur.take(f"<{n_dims}Q")
            ttype, offset = cur.take("<IQ")
            infos.append((name, GGMLQuantizationType(ttype), dims, offset))
    except struct.error as e:
        raise ValueError(f"{path} is a damaged GGUF file: {e}") from e
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ttype, dims, offset in infos:
        weights, size = GGML_QUANT_SIZES[ttype]
        nbytes = int(np.prod(dims)) // weights * size
        data = mapped[start + offset : start + offset + nbytes]
        tensors[name] = TableTensor(name, ttype, tuple(int(d) for d in reversed(dims)), data)
    return TensorTable(architecture, tensors)
