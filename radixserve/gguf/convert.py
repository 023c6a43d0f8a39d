"""Describe a GGUF file in a small Hugging Face-style folder beside it: config.json, generation_config.json,
tokenizer.json, tokenizer_config.json and the provenance file naming the GGUF. The weights stay in the GGUF: the
loader maps its blocks as they are or dequantizes them in memory (radixserve/model/loader.py), so the folder holds
a few MB, written in about a second (the header read by radixserve/gguf/tensor_table.py, not gguf-py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.gguf.reader import GGUFFile, hf_config, hf_tensor_name
from radixserve.gguf.tokenizer import build_tokenizer, end_of_generation_ids, tokenizer_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Bumped whenever the conversion's output changes, so cached folders from an older converter are rebuilt.
# 2: no float32 shards (version 1 wrote 2.5 GB of them for the default model; rebuilding removes them).
# 3: tokenizer.json keeps the merges as the GGUF's "left right" strings (see _write_tokenizer).
CONVERTER_VERSION = 3
PROVENANCE_FILE = "radixserve_gguf.json"


def converted_source(folder: Path) -> Path | None:
    """The GGUF a folder was converted from (its provenance file), or None for a folder radixserve did not convert."""
    try:
        return Path(json.loads((folder / PROVENANCE_FILE).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json with the BPE merges as "left right" strings, as the GGUF holds them, where `save` writes
    [left, right] pairs: every start parses it, and the strings parse faster (default model: 0.35 -> 0.26 s, most of
    a start's tokenizer time). Pairs stay where a token holds a space, which the string form cannot carry (byte-level
    vocabularies spell the space as another letter, so none of the supported ones do)."""
    data = json.loads(tokenizer.to_str())
    merges = data["model"].get("merges") or []
    if all(" " not in part for pair in merges for part in pair):
        data["model"]["merges"] = [" ".join(pair) for pair in merges]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Write the folder for `gguf_path` into `out_dir` (created; must not exist). Returns `out_dir`.

    ValueError if the file is not a GGUF model radixserve can serve."""
    out = Path(out_dir)
    f = GGUFFile.open(gguf_path)
    cfg = hf_config(f)
    cfg["_name_or_path"] = f.metadata.get("general.name", Path(gguf_path).stem)
    tokenizer = build_tokenizer(f.metadata)
    for name in f.tensor_names():
        hf_tensor_name(name)  # fail on a tensor we cannot map now, not at the first load
    eos_ids = end_of_generation_ids(f.metadata)

    out.mkdir(parents=True)
    _write_json(out / "config.json", cfg)
    generation = {k: cfg[k] for k in ("bos_token_id", "pad_token_id") if k in cfg}
    if eos_ids:
        generation["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    _write_json(out / "generation_config.json", generation)
    _write_tokenizer(out / "tokenizer.json", tokenizer)
    _write_json(out / "tokenizer_config.json", tokenizer_config(f.metadata, cfg.get("max_position_embeddings")))
    _write_json(out / PROVENANCE_FILE, {"converter_version": CONVERTER_VERSION, **(provenance or {})})
    return out


def convert_gguf_atomic(gguf_path: str | Path, out_dir: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Like `convert_gguf`, but builds in a temporary sibling folder and renames it into place, so `out_dir` either
    does not exist or is complete. The caller holds the lock for `out_dir` (see radixserve.model.resolve)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():  # left by a conversion that was killed; the caller's lock says nobody else is writing it
        shutil.rmtree(tmp)
    try:
        convert_gguf(gguf_path, tmp, provenance=provenance)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
