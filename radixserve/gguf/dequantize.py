"""A GGUF's tensors in float32 under Hugging Face names, dequantized in memory when a load asks for float weights
(a dense model, or int8/int4 quantized from them): nothing is written to disk, so the file alone is the model.

The block types radixserve_kernels/cpu reads are dequantized by its `gguf_dequantize` op, which gives gguf-py's numbers
bit for bit (tests/test_gguf_kernels.py) about ten times faster; other types (F16, BF16, ...), and every type where the
kernels cannot be built, by gguf-py's numpy dequantizer. llama.cpp's Q/K row order is undone (Llama files).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

import radixserve_kernels.cpu as cpu_kernels
from radixserve.gguf.reader import PERMUTED_ARCHITECTURES, hf_tensor_name, unpermute_rows
from radixserve.gguf.tensor_table import TableTensor, read_tensor_table
from radixserve.model.gguf_linear import KERNEL_TYPES


def dequantize_tensor(t: TableTensor) -> torch.Tensor:
    """One tensor as a float32 tensor of its PyTorch shape (a fresh copy: the file's map stays read-only)."""
    if t.type == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(t.data.view(np.float32)).reshape(t.shape))
    rows = t.data.reshape(t.shape[0], -1) if len(t.shape) == 2 else t.data
    ops = cpu_kernels.ops()
    if ops is not None and t.type in KERNEL_TYPES and len(t.shape) == 2:
        with warnings.catch_warnings():  # the op only reads the blocks
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(rows)
        return ops.gguf_dequantize(blocks, int(t.type), None)
    try:
        w = quants.dequantize(rows, t.type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {t.name}: cannot dequantize GGML type {t.type.name}") from e
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(t.shape))


def iter_dequantized(gguf_path: str | Path, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, in file order, one at a time."""
    table = read_tensor_table(gguf_path)
    permuted = table.architecture in PERMUTED_ARCHITECTURES
    for t in table.tensors.values():
        name = hf_tensor_name(t.name)
        w = dequantize_tensor(t)
        if permuted and ".attn_q." in t.name:
            w = unpermute_rows(w, num_heads)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_rows(w, num_kv_heads)
        yield name, w
