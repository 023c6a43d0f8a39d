"""Tokenizer: round trips, and parity with transformers' PreTrainedTokenizerFast on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from radixserve.tokenizer import Tokenizer
from tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x * 2\n\n\n",
    "你好，世界！今天天气很好。",
    "Emoji 😀🚀 and family 👨‍👩‍👧‍👦, flags 🇫🇷, skin tone 👍🏽",
    "Mixed 日本語 text with ünïcödé and Привет",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text <|endoftext|> after",
    "unseen words: xylophone quixotic zephyr 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(tok_dir))


def test_tiny_tokenizer_is_deterministic_and_small(tmp_path: Path) -> None:
    a = build_tokenizer(tmp_path / "a", vocab_size=400)
    b = build_tokenizer(tmp_path / "b", vocab_size=400)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    t = Tokenizer.from_dir(a)
    assert t.vocab_size <= 400
    assert all(t.token_to_id(s) is not None for s in SPECIAL_TOKENS)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size <= 512
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == frozenset({im_end})
    assert tok.bos_token_id is None
    assert tok.special_token_ids == frozenset(tok.token_to_id(s) for s in SPECIAL_TOKENS)
    assert tok.token_to_str(im_end) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok: Tokenizer, hf: PreTrainedTokenizerFast, text: str) -> None:
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special)
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_in_text_are_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user"


def _parts_to_text(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            m = {**m, "content": "\n".join(p["text"] for p in c)}
        out.append(m)
    return out


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 😀"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Both read."}]},
        {"role": "user", "content": "ok"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf: PreTrainedTokenizerFast, chat: list[dict], gen_prompt: bool
) -> None:
    ours = tok.apply_chat_template(chat, add_generation_prompt=gen_prompt)
    theirs = hf.apply_chat_template(_parts_to_text(chat), tokenize=False, add_generation_prompt=gen_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == gen_prompt
    assert tok.encode(ours) == hf.encode(theirs)


def test_chat_template_with_tools_matches_transformers(tok: Tokenizer, hf: PreTrainedTokenizerFast) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo d'une ville",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    chat = [{"role": "user", "content": "weather in Paris?"}]
    ours = tok.apply_chat_template(chat, tools=tools)
    assert ours == hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "Météo" in ours  # tojson keeps non-ASCII, as transformers does


def test_chat_template_errors_are_value_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="system message is only allowed first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def _copy_with(tok_dir: Path, dst: Path, **config_updates: object) -> Path:
    shutil.copytree(tok_dir, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config_updates)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_bos_added_only_when_config_says_so(tok_dir: Path, tmp_path: Path) -> None:
    with_bos = Tokenizer.from_dir(_copy_with(tok_dir, tmp_path / "a", bos_token="<|endoftext|>", add_bos_token=True))
    bos = with_bos.bos_token_id
    assert bos == with_bos.token_to_id("<|endoftext|>")
    assert with_bos.encode("hi")[0] == bos
    assert with_bos.encode("hi", add_special_tokens=False)[0] != bos
    assert with_bos.encode("<|endoftext|>hi").count(bos) == 1  # never doubled
    without = Tokenizer.from_dir(_copy_with(tok_dir, tmp_path / "b", bos_token="<|endoftext|>", add_bos_token=False))
    assert without.encode("hi")[0] != bos


def test_eos_ids_from_generation_config_and_template_variants(tok_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ bos_token is defined }}|{{ eos_token }}|{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    )
    d = _copy_with(
        tok_dir,
        tmp_path / "c",
        chat_template=[
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "tools:{{ tools | length }} {{ strftime_now('%Y') | length }}"},
        ],
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [511, 509]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 510}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == frozenset({509, 510, 511})
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "False|<|im_end|>|x"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "tools:1 4"
    (d / "chat_template.jinja").write_text("jinja file wins: {{ messages | length }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "jinja file wins: 1"


def test_reasoning_fields_and_documents_like_transformers(
    tok_dir: Path, tmp_path: Path, hf: PreTrainedTokenizerFast
) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.thinking }}/{{ m.content }};"
        "{% endfor %}{{ documents is none }}"
    )
    t = Tokenizer.from_dir(_copy_with(tok_dir, tmp_path / "r", chat_template=template))
    chat = [{"role": "assistant", "content": "a", "reasoning": "why"}, {"role": "user", "content": "u"}]
    ours = t.apply_chat_template(chat)
    assert ours == "assistant:why/why/a;user://u;True"
    assert ours == hf.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_token_bytes_are_exact_for_partial_characters(tok: Tokenizer) -> None:
    text = "你好 😀 café <|im_end|>"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a lone UTF-8 byte, not U+FFFD's three bytes
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size + 5)


def test_template_tripping_on_message_shape_is_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "tool", "content": None}])
