"""The prepared copy of a converted model's weights: the tensors exactly as the loader leaves them for one
(dtype, weight format), before oneDNN packing, in one safetensors file memory-mapped at the next start.

Why: building a quantized model from a GGUF dequantizes every tensor, casts it, takes Q8_0/Q4 codes from the blocks
and quantizes the rest (RESULTS.md, issue 38 second pass, times it). The prepared file holds the result (int8/int4
codes and scales, the other weights in the model's dtype), so a later start maps it and assigns its tensors as the
parameters: no cast, no copy, no quantization. Only oneDNN packing (an opaque layout that cannot be saved) is
redone. The GGUF's own blocks (`--quantization gguf`) need no such copy: they are the file.

Where: `<folder>/prepared/<dtype>-<weights>.safetensors`, only for folders radixserve converted itself (they carry
its provenance file; a user's Hugging Face folder is never written to). Correctness: the file's metadata records a
fingerprint of everything its tensors were built from (this format's version, torch's version, the folder's config,
the GGUF source whose tensors the loader reads); a file whose fingerprint, tensor names or shapes
do not match what this model needs is rebuilt, never used. Written to a temporary name and renamed into place, so a
reader sees a complete file or none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.llama import Linear, LlamaForCausalLM
from radixserve.model.quant import Int4Linear, Int8Linear
from radixserve.model.rope import RotaryEmbedding

# Bumped whenever what a prepared file holds changes (tensor names, layouts, how they are built).
PREPARED_VERSION = 2  # 2: int8 codes in the packed layout of radixserve_kernels/cpu/int8_linear.cpp
PREPARED_DIR = "prepared"
_FINGERPRINT_KEY = "radixserve_fingerprint"


def _stat_key(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}|absent"
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def fingerprint(folder: Path, dtype: torch.dtype, weights: str, source: Path) -> str:
    """What a prepared file of `folder` in (dtype, weights) was built from (`source`: the GGUF holding the weights):
    any change here means rebuild."""
    parts = [f"v{PREPARED_VERSION}", torch.__version__, str(dtype), weights, _stat_key(folder / "config.json")]
    parts.append(_stat_key(source))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def prepared_file(folder: Path, dtype: torch.dtype, weights: str) -> Path:
    return folder / PREPARED_DIR / f"{str(dtype).removeprefix('torch.')}-{weights}.safetensors"


def save_prepared(model: LlamaForCausalLM, path: Path, fingerprint_: str) -> None:
    """Write the model's state (call before packing: a oneDNN-blocked weight cannot be read back) atomically."""
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # one per process: concurrent starts do not collide
    try:
        save_file(state, str(tmp), metadata={_FINGERPRINT_KEY: fingerprint_, "format": "pt"})
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)


def _open(path: Path, fingerprint_: str) -> dict[str, torch.Tensor] | None:
    """The file's tensors (memory-mapped, read when touched), or None if it is absent, unreadable or stale."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if (f.metadata() or {}).get(_FINGERPRINT_KEY) != fingerprint_:
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError):
        return None


def _quantized(tensors: dict[str, torch.Tensor], name: str, in_features: int, out_features: int) -> nn.Module | None:
    """The Int8Linear / Int4Linear saved under `name`, or None if the file holds a dense weight there."""
    bias = tensors.get(f"{name}.bias")
    if f"{name}.codes" in tensors:
        return Int8Linear.from_packed(
            tensors[f"{name}.codes"], tensors[f"{name}.scale"], in_features, out_features, bias
        )
    if f"{name}.packed" in tensors:
        packed, scale_zeros = tensors[f"{name}.packed"], tensors[f"{name}.scale_zeros"]
        return Int4Linear.from_packed(packed, scale_zeros, in_features, out_features, bias)
    return None


def load_prepared(path: Path, fingerprint_: str, config: ModelConfig, dtype: torch.dtype) -> LlamaForCausalLM | None:
    """The model built from a prepared file, its tensors assigned without a copy; None if the file cannot serve
    (absent, stale, or not holding exactly the tensors this model needs): the caller then rebuilds it."""
    tensors = _open(path, fingerprint_)
    if tensors is None:
        return None
    with torch.device("meta"):  # no memory for the skeleton: every tensor is replaced by the file's
        model = LlamaForCausalLM(config, dtype)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, Linear):
                continue
            out_features, in_features = child.weight.shape
            if (lin := _quantized(tensors, full, in_features, out_features)) is not None:
                setattr(parent, name, lin)
    if model.lm_head is None:  # a quantized tied head is its own module; a dense one is made at packing
        model.tied_head = _quantized(tensors, "tied_head", config.hidden_size, config.vocab_size)
    wanted = dict(model.state_dict(keep_vars=True))
    if set(wanted) != set(tensors):
        return None
    for name, current in wanted.items():
        t = tensors[name]
        if t.shape != current.shape or t.dtype != current.dtype:
            return None
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t
    c = config
    model.rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
    return model
