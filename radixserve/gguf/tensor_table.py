"""A GGUF file's tensor table, architecture and (when asked) metadata without gguf-py's parse.

Why: gguf.GGUFReader builds numpy views of every metadata item, including the 150k-entry vocabulary and merges, which
took 10-50 s on the default model (a busy 2-core machine); loading the tensors needs only their names, types, shapes
and offsets, and writing the config and tokenizer needs plain Python values. This walks the header once with
`struct`, skipping the values nobody asked for (every start) or reading them all (`metadata=True`, once per model:
about a second for the default model's vocabulary), and maps the data read-only. Layout (ggml's gguf.md): magic,
version, tensor count, metadata count; metadata key-value pairs; tensor infos (name, dims innermost first, type,
offset); then the data, aligned to `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types: their struct codes (uint8, int8, uint16, int16, uint32, int32, float32, bool, uint64, int64,
# float64); 8 is a string, 9 an array.
_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FIXED = {vtype: struct.calcsize(code) for vtype, code in _CODES.items()}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes


@dataclass(frozen=True)
class TableTensor:
    """One tensor: `data` is its bytes in the read-only map (uint8), `shape` PyTorch's order (outermost first)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class TensorTable:
    """`metadata` holds every key's value (str, int, float, bool or a list of them) when read with metadata=True,
    else only general.architecture and general.alignment; `mapped` is the whole file's read-only map."""

    architecture: str
    tensors: dict[str, TableTensor]
    metadata: dict[str, Any]
    mapped: np.ndarray


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
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

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
            elif etype == _STRING:  # the vocabulary and merges: 300k strings in the default model, read every start
                buf, pos, length = self.buf, self.pos, _LENGTH.unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")

    def value(self, vtype: int) -> Any:
        if vtype in _CODES:
            return self.take("<" + _CODES[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        etype, count = self.take("<IQ")
        if etype in _CODES:  # one unpack for the whole array (token types: 150k int32 in the default model)
            return list(self.take(f"<{count}{_CODES[etype]}"))
        return [self.value(etype) for _ in range(count)]


def read_tensor_table(path: str | Path, metadata: bool = False) -> TensorTable:
    """The architecture, tensors and (with `metadata`) every metadata value of a GGUF file; ValueError if it is not
    a GGUF file this reader understands."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    try:
        magic, version, n_tensors, n_kv = cur.take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        values: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.take("<I")
            wanted = (key == "general.architecture" and vtype == _STRING) or (
                key == "general.alignment" and vtype == _UINT32
            )
            if metadata or wanted:
                values[key] = cur.value(vtype)
            else:
                cur.skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.take("<I")
            dims = cur.take(f"<{n_dims}Q")
            ttype, offset = cur.take("<IQ")
            infos.append((name, GGMLQuantizationType(ttype), dims, offset))
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is a damaged GGUF file: {e}") from e
    architecture, alignment = values.get("general.architecture", ""), values.get("general.alignment", 32)
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ttype, dims, offset in infos:
        weights, size = GGML_QUANT_SIZES[ttype]
        nbytes = int(np.prod(dims)) // weights * size
        data = mapped[start + offset : start + offset + nbytes]
        tensors[name] = TableTensor(name, ttype, tuple(int(d) for d in reversed(dims)), data)
    return TensorTable(architecture, tensors, values, mapped)
