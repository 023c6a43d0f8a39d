"""Build a `tokenizers` tokenizer (tokenizer.json) and a tokenizer_config.json dict from GGUF `tokenizer.*` metadata.

GGUF stores a byte-level BPE vocabulary as `tokenizer.ggml.tokens` (already spelled in GPT-2's byte alphabet),
`tokenizer.ggml.merges` ("left right" strings, best first), `tokenizer.ggml.token_type` (1 normal, 3 control,
4 user-defined, 5 unused) and names the pre-tokenizer split in `tokenizer.ggml.pre`.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer splits by `tokenizer.ggml.pre` name: (regex, ignore_merges). The regexes are the models' own
# published split patterns; llama.cpp skips merges for a piece that is whole in the vocabulary for Llama 3.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, True),
    "gpt-2": (_GPT2_SPLIT, False),
}

# Token texts llama.cpp also treats as end of generation, beside the eos/eot/eom ids the metadata names.
_END_OF_GENERATION_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the rest shift past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _token_id_name(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    tokens = metadata["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer the metadata describes; ValueError for other tokenizer kinds or unknown splits."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer {kind!r} is not supported; radixserve reads byte-level BPE ('gpt2') vocabularies"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre is None:  # llama.cpp then guesses a split that is wrong for most models; refuse rather than mis-tokenize
        raise ValueError(
            "GGUF file has no tokenizer.ggml.pre (how to split text); re-convert it with a recent llama.cpp"
        )
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZERS))}")
    split, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spelled(token: str) -> str:
        # A token written in plain text (some converters do this for added tokens) is respelled in the byte alphabet.
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are special; user-defined ones (<tool_call>, ...) are matched whole but kept
    # when decoding with skip_special_tokens. A control token outside the byte alphabet is not a real vocabulary entry.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == CONTROL and set(t) <= letters
        ]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    tok.post_processor = _post_processor(metadata)
    return tok


def _post_processor(metadata: dict[str, Any]) -> Any:
    """Adds BOS/EOS around each sequence when the metadata asks for it (tokenizer.ggml.add_bos_token/add_eos_token)."""
    bos = _token_id_name(metadata, "bos") if metadata.get("tokenizer.ggml.add_bos_token", False) else None
    eos = _token_id_name(metadata, "eos") if metadata.get("tokenizer.ggml.add_eos_token", False) else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)

    def around(seq: str, type_id: int) -> list[str]:
        return [*([f"{bos}:{type_id}"] if bos else []), f"${seq}:{type_id}", *([f"{eos}:{type_id}"] if eos else [])]

    specials = [(t, metadata[f"tokenizer.ggml.{k}_token_id"]) for t, k in ((bos, "bos"), (eos, "eos")) if t]
    return processors.TemplateProcessing(
        single=around("A", 0),
        pair=around("A", 0) + around("B", 1),
        special_tokens=specials,
    )


def end_of_generation_ids(metadata: dict[str, Any]) -> list[int]:
    """Token ids that end a generation: eos, eot and eom from the metadata, then well-known end-of-turn control tokens."""
    keys = (f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom"))
    ids = list(dict.fromkeys(metadata[k] for k in keys if k in metadata))
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens", [])
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == CONTROL and t in _END_OF_GENERATION_TEXTS and i not in ids:
            ids.append(i)
    return ids


def tokenizer_config(metadata: dict[str, Any], context_length: int | None = None) -> dict[str, Any]:
    """A Hugging Face tokenizer_config.json dict: special tokens, add_bos/add_eos and the chat template."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        cfg[name] = _token_id_name(metadata, key)
    if "tokenizer.chat_template" in metadata:
        cfg["chat_template"] = metadata["tokenizer.chat_template"]
    if context_length:
        cfg["model_max_length"] = context_length
    return cfg
