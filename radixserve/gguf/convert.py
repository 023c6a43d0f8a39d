"""Convert a GGUF file into a Hugging Face-style folder the engine loads like any other checkpoint:
config.json, generation_config.json, float32 safetensors shards with their index, tokenizer.json, tokenizer_config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from radixserve.gguf.reader import GGUFFile, hf_config, hf_tensor_name, iter_hf_tensors, tensor_sizes
from radixserve.gguf.tokenizer import build_tokenizer, end_of_generation_ids, tokenizer_config

# Bumped whenever the conversion's output changes, so cached folders from an older converter are rebuilt.
CONVERTER_VERSION = 1
PROVENANCE_FILE = "radixserve_gguf.json"
SHARD_BYTES = 1 << 30


def _plan_shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Group tensor names (in file order) into shards of at most `limit` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def converted_source(folder: Path) -> Path | None:
    """The GGUF a folder was converted from (its provenance file), or None for a folder radixserve did not convert."""
    try:
        return Path(json.loads((folder / PROVENANCE_FILE).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, progress: bool = True, provenance: dict[str, Any] | None = None
) -> Path:
    """Write the HF folder for `gguf_path` into `out_dir` (created; must not exist). Returns `out_dir`.

    ValueError if the file is not a GGUF model radixserve can serve (checked before any tensor is dequantized)."""
    out = Path(out_dir)
    f = GGUFFile.open(gguf_path)
    cfg = hf_config(f)
    cfg["_name_or_path"] = f.metadata.get("general.name", Path(gguf_path).stem)
    tokenizer = build_tokenizer(f.metadata)
    for name in f.tensor_names():
        hf_tensor_name(name)  # fail on a tensor we cannot map before spending minutes dequantizing
    eos_ids = end_of_generation_ids(f.metadata)

    out.mkdir(parents=True)
    _write_json(out / "config.json", cfg)
    generation = {k: cfg[k] for k in ("bos_token_id", "pad_token_id") if k in cfg}
    if eos_ids:
        generation["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    _write_json(out / "generation_config.json", generation)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(f.metadata, cfg.get("max_position_embeddings")))

    sizes = tensor_sizes(f)
    shards = _plan_shards(sizes, SHARD_BYTES)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shard_of = {name: files[i] for i, names in enumerate(shards) for name in names}
    last_of_shard = {names[-1] for names in shards}
    weight_map: dict[str, str] = {}
    pending: dict[str, np.ndarray] = {}
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="dequantizing GGUF", disable=not progress)
    with bar:
        for gguf_name, hf_name, array in iter_hf_tensors(f, cfg):
            pending[hf_name] = array
            weight_map[hf_name] = shard_of[gguf_name]
            bar.update(sizes[gguf_name])
            if gguf_name in last_of_shard:  # write the shard out and free its memory
                save_file(pending, str(out / shard_of[gguf_name]), metadata={"format": "pt"})
                pending = {}
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
    )
    _write_json(out / PROVENANCE_FILE, {"converter_version": CONVERTER_VERSION, **(provenance or {})})
    return out


def convert_gguf_atomic(
    gguf_path: str | Path, out_dir: str | Path, progress: bool = True, provenance: dict[str, Any] | None = None
) -> Path:
    """Like `convert_gguf`, but builds in a temporary sibling folder and renames it into place, so `out_dir` either
    does not exist or is complete. The caller holds the lock for `out_dir` (see radixserve.model.resolve)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():  # left by a conversion that was killed; the caller's lock says nobody else is writing it
        shutil.rmtree(tmp)
    try:
        convert_gguf(gguf_path, tmp, progress=progress, provenance=provenance)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
