"""ChatPromptBuilder alone: multi-turn prompts extend the previous prompt + generated ids, and never change the text."""

from __future__ import annotations


import pytest

from radixserve.io import STOP_LENGTH, FinishReason
from radixserve.server.chat_prompt import ChatPromptBuilder
from radixserve.tokenizer import Tokenizer
from tiny_tokenizer import build_tokenizer

EOS = {"type": "stop", "matched": None}
LENGTH = STOP_LENGTH


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tokenizer(tmp_path_factory.mktemp("chat-prompt-tok")))


def odd_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids that spell `text` but are not its tokenization: one byte-level token per ASCII character (space is Ġ)."""
    ids = [tok.token_to_id("\u0120" if c == " " else c) for c in text]
    assert None not in ids
    assert ids != tok.encode(text, add_special_tokens=False)
    return ids  # type: ignore[return-value]


def test_without_remembered_answers_it_is_the_plain_template(tok: Tokenizer) -> None:
    b = ChatPromptBuilder(tok)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
    ]
    assert b.build(msgs, "") == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)


def test_turns_extend_prompt_plus_generated_ids(tok: Tokenizer) -> None:
    b = ChatPromptBuilder(tok)
    msgs = [{"role": "user", "content": "hi"}]
    context: list[int] = []
    for turn, answer in enumerate(["the quick fox", "Hello world", "the lazy dog"]):
        prompt = b.build(msgs, "ns")
        assert prompt[: len(context)] == context, turn  # the whole previous turn is a prefix
        assert tok.decode(prompt, skip_special_tokens=False) == tok.apply_chat_template(msgs)  # same text
        generated = odd_ids(tok, answer) + [tok.token_to_id("<|im_end|>")]
        b.remember("ns", answer, generated, FinishReason("stop", generated[-1]))
        context = prompt + generated[:-1]  # the EOS is replaced by the template's own end-of-turn
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"question {turn}"}]


def test_namespaces_are_separate(tok: Tokenizer) -> None:
    b = ChatPromptBuilder(tok)
    b.remember("a", "hello there", odd_ids(tok, "hello there"), LENGTH)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "ok"},
    ]
    plain = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert b.build(msgs, "b") == plain
    assert b.build(msgs, "a") != plain


def test_ids_that_do_not_spell_the_text_are_not_kept(tok: Tokenizer) -> None:
    b = ChatPromptBuilder(tok)
    b.remember("", "hello there", odd_ids(tok, "hello where"), LENGTH)
    b.remember("", "", [], LENGTH)
    b.remember("", "hello there", odd_ids(tok, "hello there"), FinishReason("abort", None, "x"))
    assert b._answers == {}


def test_stop_string_tail_is_trimmed(tok: Tokenizer) -> None:
    """A stop string cut the text: the ids past it are dropped so the kept ids spell exactly the text."""
    b = ChatPromptBuilder(tok)
    ids = odd_ids(tok, "hello there STOP")
    b.remember("", "hello there", ids, FinishReason("stop", " STOP"))
    assert list(b._answers[("", "hello there")]) == ids[: len("hello there")]


def test_template_that_rewrites_content_falls_back(tok: Tokenizer) -> None:
    """A template that trims content would not render the answer verbatim: no splice, the plain encoding is used."""
    trimming = Tokenizer(
        tok._tok,
        {
            **tok.config,
            "chat_template": (
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            ),
        },
    )
    b = ChatPromptBuilder(trimming)
    b.remember("", " hello there ", odd_ids(tok, " hello there "), LENGTH)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " hello there "},
        {"role": "user", "content": "ok"},
    ]
    assert b.build(msgs, "") == trimming.encode(trimming.apply_chat_template(msgs), add_special_tokens=False)


def test_lru_capacity(tok: Tokenizer) -> None:
    b = ChatPromptBuilder(tok, capacity=2)
    for text in ["one", "two", "three"]:
        b.remember("", text, tok.encode(text, add_special_tokens=False), LENGTH)
    assert [k[1] for k in b._answers] == ["two", "three"]
