"""Load a Llama-family model from a Hugging Face folder (`config.json` plus memory-mapped `*.safetensors` shards) or
from the GGUF a folder radixserve wrote names (its blocks mapped as they are, or dequantized in memory)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from radixserve.config import ModelConfig
from radixserve.gguf import huge_pages
from radixserve.gguf.convert import converted_source
from radixserve.model.llama import LlamaForCausalLM, can_pack
from radixserve.model.parallel import Shard, local_config, parallelize, plan_shard, shard_weights, tie_parallel_head
from radixserve.model.prepared import fingerprint, load_prepared, prepared_file, save_prepared
from radixserve.model.packing import DeferredPacking
from radixserve.model.quant import quantize_model

log = logging.getLogger(__name__)

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


def _gguf_source(path: Path) -> Path | None:
    """The GGUF whose tensors are the weights of a folder radixserve wrote for it; None for a Hugging Face folder
    (its safetensors are the weights). ValueError if the GGUF is gone."""
    source = converted_source(path)
    if source is not None and not source.is_file():
        raise ValueError(f"{path} describes the GGUF file {source}, which no longer exists")
    return source


def _float_weights(path: Path, config: ModelConfig, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight: dequantized in memory from a converted folder's GGUF, else read
    from the folder's safetensors."""
    source = _gguf_source(path)
    if source is None:
        return iter_safetensors(files)
    from radixserve.gguf.dequantize import iter_dequantized

    return iter_dequantized(source, config.num_heads, config.num_kv_heads)


def _gguf_blocks(path: Path, fmt: str, config: ModelConfig) -> dict:
    """For a folder converted from a GGUF: its blocks that map onto `fmt` without a float detour
    (radixserve/gguf/blocks.py), by Hugging Face name; {} otherwise."""
    from radixserve.gguf.blocks import mapped_tensors

    source = _gguf_source(path)
    return {} if source is None else mapped_tensors(source, fmt, config.num_heads, config.num_kv_heads)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    tp: TPGroup | None = None,
    defer_packing: bool = False,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """`load_unpacked`, then oneDNN's layouts where they pay (`pack_loaded`)."""
    try:
        config, model = load_unpacked(path, dtype, device, quantization, tp)
    finally:
        huge_pages.drop_early()  # a map `radixserve serve` started early that this load did not take is freed
    return config, pack_loaded(model, dtype, device, quantization, defer_packing)


def load_unpacked(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    tp: TPGroup | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The model in `dtype` on `device` filled from the folder's weights, not yet packed; ValueError for a bad
    folder.

    quantization: none, int8, int4 (CpuChoice.quantization) or gguf: the linears multiply with the blocks of the
    GGUF the folder was converted from, mapped as they are (no float shard is read, nothing is prepared).
    With `tp`, the model is this rank's shard (radixserve/model/parallel.py) and `model.config` its per-rank
    config; the returned config is the whole model's. A folder radixserve converted keeps a prepared copy of the
    result per (dtype, format) that later loads map instead of rebuilding (radixserve/model/prepared.py)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    config = read_config(path)
    if quantization == "gguf":
        return config, _gguf_blocks_model(path, config, dtype, device, tp)
    source = _gguf_source(path)
    files = [] if source is not None else safetensors_files(path)
    shard = None if tp is None else plan_shard(config, tp.size, tp.rank)
    if shard is not None and quantization != "none":  # Int8Linear does not carry the row-parallel sum yet
        raise ValueError(f"tensor parallelism with quantization {quantization!r} is not supported yet: use 'none'")
    # Worth a file where the load does more than dequantize to float32: a cast or a quantization, on CPU (the
    # prepared tensors are CPU memory maps) and unsharded. float32 (tests, references) is built in memory each time.
    prepare = (
        source is not None
        and shard is None
        and torch.device(device).type == "cpu"
        and (quantization != "none" or dtype != torch.float32)
    )
    if prepare:
        target = prepared_file(path, dtype, quantization)
        key = fingerprint(path, dtype, quantization, source)
        model = load_prepared(target, key, config, dtype)
        if model is None:
            model = _build(path, config, files, dtype, device, quantization)
            try:
                save_prepared(model, target, key)
            except (OSError, SafetensorError) as e:  # a full disk or a read-only cache costs the next start, only
                log.warning("could not save the prepared weights to %s (%s): the next start rebuilds them", target, e)
    else:
        model = _build(path, config, files, dtype, device, quantization, shard, tp)
    return config, model


def _gguf_blocks_model(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: str | torch.device, tp: TPGroup | None
) -> LlamaForCausalLM:
    """The model over the blocks of the GGUF the folder was converted from (radixserve/model/gguf_model.py)."""
    from radixserve.model.gguf_model import load_gguf_model

    source = _gguf_source(path)
    if source is None:
        raise ValueError(f"quantization 'gguf' runs a GGUF file's own blocks; {path} was not converted from one")
    if tp is not None or torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("quantization 'gguf' is a CPU path, unsharded, with float32 or bfloat16 activations")
    return load_gguf_model(source, config, dtype)


def _build(
    path: Path,
    config: ModelConfig,
    files: list[Path],
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: str,
    shard: Shard | None = None,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model from the float weights (`_float_weights`), cast to `dtype` and quantized to `quantization`, not yet
    packed."""
    # Built straight in `dtype` with uninitialized weights: no random init, no float32 copy of a bf16 model.
    with torch.device(device):
        model = LlamaForCausalLM(config if shard is None else local_config(config, shard), dtype)
        if shard is not None and tp is not None:
            parallelize(model, shard, tp.group)
    weights = _float_weights(path, config, files)
    model.load_weights(weights if shard is None else shard_weights(weights, config, shard))
    if shard is not None and tp is not None:
        tie_parallel_head(model, shard, tp.group)
    if quantization in ("int8", "int4"):
        quantize_model(model, quantization, mapped=_gguf_blocks(path, quantization, config))
    return model


def pack_loaded(
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: str,
    defer: bool = False,
) -> LlamaForCausalLM:
    """oneDNN's layouts for a loaded model, built at every load (they cannot be saved); returns it in eval mode.

    defer: on a background thread, each module packing itself first if it runs before the thread reached it
    (radixserve/model/packing.py): the same outputs, and the load returns before the packing is done."""
    # A quantized model has no Linear left for oneDNN to pack (its codes are packed when quantized, and saved so).
    quantized = quantization in ("int8", "int4", "gguf")
    jobs = model.packing_jobs() if not quantized and can_pack(dtype, torch.device(device)) else []
    if defer and jobs:
        model.packing = DeferredPacking(jobs)
        model.packing.start()
    else:
        for _, pack in jobs:
            pack()
    return model.eval()
