"""Read a GGUF file: its metadata as plain Python values, a Hugging Face `config.json` dict, and the Hugging Face
names of its tensors (llama.cpp's Q/K row order undone where the converter applied it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.gguf.tensor_table import TensorTable, read_tensor_table

# GGUF `general.architecture` -> Hugging Face class. Mistral files say "llama" (see `hf_config`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp's converter interleaves the rotary halves of Q and K rows for these (HF's rotate_half layout
# becomes GGML's adjacent-pairs layout); Qwen files keep HF's layout.
PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata as plain Python values and its tensors, memory-mapped as stored."""

    path: Path
    table: TensorTable

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Parse the header; raises ValueError if `path` is not a readable GGUF file."""
        path = Path(path)
        try:
            with open(path, "rb") as fh:
                magic = fh.read(4)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        return cls(path=path, table=read_tensor_table(path, metadata=True))

    @property
    def metadata(self) -> dict[str, Any]:
        return self.table.metadata

    @property
    def architecture(self) -> str:
        return self.table.architecture

    def arch_key(self, key: str, default: Any = None) -> Any:
        """The architecture-prefixed metadata value, e.g. arch_key("block_count") reads "qwen2.block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        return list(self.table.tensors)


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for the model in `f`; ValueError for an architecture we do not serve."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; radixserve reads {', '.join(ARCHITECTURES)}")
    names = set(f.tensor_names())
    if "rope_freqs.weight" in names:
        # Llama 3.1-style rope scaling baked into a tensor; HF's rope_scaling parameters cannot be read back from it.
        raise ValueError(f"{f.path}: GGUF files with a rope_freqs tensor (Llama 3.1 rope scaling) are not supported")
    architecture = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(f.metadata.get("general.name", "")).lower():
        architecture = "MistralForCausalLM"
    hidden = f.arch_key("embedding_length")
    heads = f.arch_key("attention.head_count")
    kv_heads = f.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: our decoders need one
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{f.path}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    head_dim = f.arch_key("attention.key_length") or hidden // heads
    embed = f.table.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{f.path} has no token_embd.weight tensor")
    vocab_size = embed.shape[0]  # [vocab, hidden]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(architecture, arch),
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": f.arch_key("feed_forward_length"),
        "num_hidden_layers": f.arch_key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": f.arch_key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": f.arch_key("rope.freq_base", 10000.0),
        "max_position_embeddings": f.arch_key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    scaling = f.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": f.arch_key("rope.scaling.factor", 1.0)}
        original = f.arch_key("rope.scaling.original_context_length")
        if original:
            cfg["rope_scaling"]["original_max_position_embeddings"] = original
    window = f.arch_key("attention.sliding_window")
    if window:
        cfg["sliding_window"] = window
        cfg["use_sliding_window"] = True
    for key in ("bos", "eos", "padding"):
        token_id = f.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[{"padding": "pad"}.get(key, key) + "_token_id"] = token_id
    return cfg


def hf_tensor_name(name: str) -> str:
    """The Hugging Face parameter name for a GGUF tensor name; ValueError for tensors our decoders do not have."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {name!r} (not a Llama/Qwen decoder tensor)")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (i, i + d/2) were stored as adjacent pairs (2i, 2i+1)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
