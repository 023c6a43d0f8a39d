"""Load a Llama-family model from a Hugging Face folder: `config.json` plus memory-mapped `*.safetensors` shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from radixserve.config import ModelConfig
from radixserve.model.llama import LlamaForCausalLM, can_pack
from radixserve.model.parallel import local_config, parallelize, plan_shard, shard_weights, tie_parallel_head
from radixserve.model.quant import keep_dense_copies, quantize_model

if TYPE_CHECKING:
    from radixserve.distributed import TPGroup


def read_config(path: Path) -> ModelConfig:
    """Parse `path/config.json` into a ModelConfig; ValueError when it is absent, not JSON, or unsupported."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config_file.read_text())
        return ModelConfig.from_hf(raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{config_file} is not a valid model config: {e!r}") from e


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a folder: those named by `model.safetensors.index.json` if present, else `*.safetensors`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names missing shard(s): {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file, memory-mapped: a tensor is read only when it is copied."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"cannot read weights from {file}: {e}") from e


def _gguf_blocks(path: Path, fmt: str, config: ModelConfig) -> dict:
    """For a folder converted from a GGUF that is still on disk: its blocks that map onto `fmt` without a float
    detour (radixserve/gguf/blocks.py), by Hugging Face name; {} otherwise."""
    from radixserve.gguf.blocks import mapped_tensors
    from radixserve.gguf.convert import PROVENANCE_FILE

    try:
        source = Path(json.loads((path / PROVENANCE_FILE).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not source.is_file():
        return {}
    return mapped_tensors(source, fmt, config.num_heads, config.num_kv_heads)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    tp: TPGroup | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model in `dtype` on `device` and fill it from the folder's weights; ValueError for a bad folder.

    quantization: none, int8, int4, or int8+bf16 (int8 codes plus a packed bf16 copy of them, CpuChoice.weights).
    With `tp`, the model is this rank's shard (radixserve/model/parallel.py) and `model.config` its per-rank
    config; the returned config is the whole model's."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    config = read_config(path)
    files = safetensors_files(path)
    shard = None if tp is None else plan_shard(config, tp.size, tp.rank)
    if shard is not None and quantization != "none":  # Int8Linear does not carry the row-parallel sum yet
        raise ValueError(f"tensor parallelism with quantization {quantization!r} is not supported yet: use 'none'")
    # Built straight in `dtype` with uninitialized weights: no random init, no float32 copy of a bf16 model.
    with torch.device(device):
        model = LlamaForCausalLM(config if shard is None else local_config(config, shard), dtype)
        if shard is not None:
            parallelize(model, shard, tp.group)
    weights = iter_safetensors(files)
    model.load_weights(weights if shard is None else shard_weights(weights, config, shard))
    if shard is not None:
        tie_parallel_head(model, shard, tp.group)
    if quantization in ("int8", "int4", "int8+bf16"):
        # replaces every Linear, so nothing is left for oneDNN to pack
        fmt = quantization.removesuffix("+bf16")
        quantize_model(model, fmt, mapped=_gguf_blocks(path, fmt, config))
        if quantization == "int8+bf16" and can_pack(dtype, torch.device(device)):
            keep_dense_copies(model)  # int8 for 1-row steps, the same codes packed in bf16 for the rest
    elif can_pack(dtype, torch.device(device)):
        model.pack_for_cpu()
    return config, model.eval()
