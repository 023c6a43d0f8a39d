"""GGUF metadata read without a file: tensor names, the byte-level alphabet, and the tokenizer built from the
metadata (BOS rule, end-of-generation ids, what it refuses)."""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from radixserve.gguf.reader import hf_tensor_name
from radixserve.gguf.tokenizer import build_tokenizer, byte_alphabet, end_of_generation_ids, tokenizer_config


def test_tensor_names_and_byte_alphabet() -> None:
    assert hf_tensor_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256 and set(alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"


def llama3_like_metadata(**overrides: object) -> dict:
    """A byte-level vocabulary with one merge and Llama 3's special tokens and BOS rule."""
    tokens = [*byte_alphabet().values(), "hi", "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3, 3, 3],
        "tokenizer.ggml.merges": ["h i"],
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 259,
        "tokenizer.ggml.eot_token_id": 258,
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(overrides)
    return meta


def test_tokenizer_bos_and_end_of_generation_ids() -> None:
    meta = llama3_like_metadata()
    tok = build_tokenizer(meta)
    assert tok.encode("hi").ids == [257, 256]
    assert tok.encode("hi<|eot_id|>", add_special_tokens=False).ids == [256, 258]
    assert tok.decode([257, 256, 258]) == "hi"
    assert end_of_generation_ids(meta) == [259, 258]
    cfg = tokenizer_config(meta, 8192)
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"], cfg["model_max_length"]) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        True,
        8192,
    )
    assert build_tokenizer(llama3_like_metadata(**{"tokenizer.ggml.add_bos_token": False})).encode("hi").ids == [256]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tokenizer.ggml.model": "llama"}, "GGUF tokenizer 'llama' is not supported"),
        ({"tokenizer.ggml.pre": "some-new-model"}, "pre-tokenizer 'some-new-model' is not supported"),
        ({"tokenizer.ggml.pre": None}, "no tokenizer.ggml.pre"),
    ],
)
def test_tokenizer_refuses_what_it_cannot_reproduce(overrides: dict, message: str) -> None:
    meta = {k: v for k, v in llama3_like_metadata(**overrides).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        build_tokenizer(meta)
