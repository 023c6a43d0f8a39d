"""IncrementalDetokenizer: streaming equals a full decode, UTF-8 safety, and stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.tokenizer import Tokenizer
from tiny_tokenizer import SAMPLE_TEXT, build_tokenizer

TEXTS = [
    "Hello 你好世界！今天天气很好 😀🚀 done.",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, 👍🏽 thumbs; 日本語のテキスト and 한국어 문장.",
    "def f(x):\n    return x  # 注释 🤖\n" * 3,
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 rare four-byte letters ✓ ∑ ∞",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(tok: Tokenizer, ids: list[int], chunk: int = 1, **kw: object) -> tuple[list[str], str | None, str]:
    """Feed ids chunk by chunk; return (deltas, matched stop, text after flush)."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas, matched = [], None
    for i in range(0, len(ids), chunk):
        delta, matched = d.step(ids[i : i + chunk])
        deltas.append(delta)
        assert d.text == "".join(deltas)
        if matched is not None:
            break
    if matched is None:
        deltas.append(d.flush())
    return deltas, matched, "".join(deltas)


def test_texts_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guard that the streaming tests below exercise half characters: some single tokens decode to U+FFFD.
    for text in TEXTS:
        assert any("\ufffd" in tok.token_to_str(i) for i in tok.encode(text))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streaming_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas, matched, out = stream(tok, ids, chunk)
    assert matched is None
    assert out == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character


def test_long_stream_with_prompt_context(tok: Tokenizer) -> None:
    text = " ".join(SAMPLE_TEXT[:15])
    ids = tok.encode(text)
    prompt, out_ids = ids[:40], ids[40:]
    assert len(out_ids) > 200  # long enough for the id window to be trimmed several times
    _, _, out = stream(tok, out_ids, prompt_ids=prompt)
    assert out == tok.decode(out_ids)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n你好<|im_end|>")
    assert stream(tok, ids)[2] == "assistant\n你好"
    assert stream(tok, ids, skip_special_tokens=False)[2] == "<|im_start|>assistant\n你好<|im_end|>"


def test_invalid_utf8_is_flushed_not_lost(tok: Tokenizer) -> None:
    # A lone lead byte that never completes: held while streaming, then emitted at flush like a full decode.
    lead = tok.token_to_id("ä")  # the byte-level symbol of byte 0xE4, the lead byte of a 3-byte character
    assert lead is not None
    ids = tok.encode("ab") + [lead]
    deltas, _, out = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert out == tok.decode(ids) == "ab\ufffd"


@pytest.mark.parametrize(
    "text,stop",
    [
        ("The answer is 42. END of story", "END"),
        ("你好世界！今天天气很好", "天气"),  # CJK stop inside multi-byte tokens
        ("emoji 😀🚀 rocket", "🚀"),
        ("def f(x):\n    return x\n\nprint(f(1))", "\n\n"),
        ("one two three", "e t"),  # spans a token boundary
    ],
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_cuts_before_match(tok: Tokenizer, text: str, stop: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas, matched, out = stream(tok, ids, chunk, stop=[stop])
    assert matched == stop
    assert out == text[: text.index(stop)]


def test_random_stop_strings_never_emitted_partially(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(150):
        text = rng.choice(TEXTS)
        start = rng.randrange(len(text) - 1)
        stop = text[start : start + rng.randint(1, 6)]
        expected = text[: text.index(stop)]
        d = IncrementalDetokenizer(tok, stop=[stop, "never-present-stop"])
        matched = None
        for i in tok.encode(text):
            _, matched = d.step([i])
            assert expected.startswith(d.text)  # nothing of the stop (or past it) is ever emitted
            if matched:
                break
        assert matched == stop
        assert d.text == expected
        assert d.flush() == ""


def test_partial_stop_is_held_then_released(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, stop=["STOP!"])
    text, _ = d.step(tok.encode("go ST"))
    assert text == "go " and d.text == "go "  # "ST" might start "STOP!"
    text, matched = d.step(tok.encode("OP? no"))
    assert matched is None and d.text == "go STOP? no"  # released as soon as it cannot match any more
    d2 = IncrementalDetokenizer(tok, stop=["STOP!"])
    d2.step(tok.encode("go STO"))
    assert d2.flush() == "STO" and d2.text == "go STO"  # at finish the held tail is not part of a match


def test_earliest_of_several_stops_wins(tok: Tokenizer) -> None:
    _, matched, out = stream(tok, tok.encode("alpha beta gamma"), 100, stop=["gamma", "beta", "zzz"])
    assert matched == "beta" and out == "alpha "
    _, matched, out = stream(tok, tok.encode("alpha beta gamma"), 1, stop=["ta g", "beta"])
    assert matched == "beta" and out == "alpha "


def test_metaspace_tokenizer_keeps_leading_space_with_prompt_context() -> None:
    # SentencePiece-style: a token's leading space is dropped at the start of a decode, so context matters.
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(
        SAMPLE_TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    )
    tok = Tokenizer(hf)
    prompt = tok.encode("Hello, world!")
    out_ids = tok.encode("How are you today? Fine.")
    expected = tok.decode(prompt + out_ids)[len(tok.decode(prompt)) :]
    assert expected.startswith(" How")
    _, _, out = stream(tok, out_ids, prompt_ids=prompt)
    assert out == expected
    _, _, alone = stream(tok, out_ids)
    assert alone == tok.decode(out_ids)


def test_stop_regex_no_stop_trim_and_min_new_tokens(tok: Tokenizer) -> None:
    """A stop regex ends the text with the token that completes a match (the match kept, as SGLang); no_stop_trim
    keeps a matched stop string; while not armed (short of min_new_tokens) no stop matches."""
    text = "the year 1984 was long; then came more"
    ids = tok.encode(text)
    _, matched, out = stream(tok, ids, stop_regex=[r"\d{4}"])
    assert matched == r"\d{4}" and text.startswith(out) and "1984" in out and "was" not in out
    _, matched, out = stream(tok, ids, stop=[";"], no_stop_trim=True)
    assert matched == ";" and out == "the year 1984 was long;"
    d = IncrementalDetokenizer(tok, stop=["year"])
    d.armed = False
    for i in ids:
        assert d.step([i])[1] is None
    d.flush()
    assert d.text == text
