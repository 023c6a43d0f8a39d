"""The real default model (Qwen2.5-Coder-0.5B-Instruct GGUF) against transformers loading the same file: tokenizer and
chat template, dequantized weights, greedy decoding; a 4-turn chat that must reuse the cache; `radixserve generate`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve.gguf.dequantize import iter_dequantized
from radixserve.tokenizer import Tokenizer
from real_model import hf_model, hf_tokenizer, real_engine, real_gguf, real_model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]

MIXED_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? We'll see; they've gone.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i * i); }  // C code\r\n\r\n',
    "机器学习和自然语言处理很有意思。日本語のテキスト。한국어 문장도 있습니다.",
    "Emoji: 😀 🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦 🤖🧠",
    "    leading spaces,\t\ttabs,   runs   of    spaces   \n\n\n\n and trailing    ",
    "Ünïcödé naïve café, Straße, Привет мир, e\u0301 (decomposed)",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|><|endoftext|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "12345678901234567890 0x1F 1e-6 -42 +7 100% $9.99",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [
        {"role": "system", "content": "You are a senior Rust engineer."},
        {"role": "user", "content": "Explain ownership in Rust."},
        {
            "role": "assistant",
            "content": "Every value has a single owner; when the owner goes out of scope, it is dropped.",
        },
        {"role": "user", "content": "And borrowing?"},
    ],
]

GREEDY_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain what a radix tree is and why it is useful for prefix caching, in three sentences.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
]


def test_tokenizer_matches_transformers(real_model_dir: Path, hf_tokenizer: Any) -> None:
    ours = Tokenizer.from_dir(real_model_dir)
    for text in MIXED_TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert (
            ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False) == text
        )
        assert ours.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    for messages in CONVERSATIONS:
        want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == want
        assert ours.encode(want, add_special_tokens=False) == hf_tokenizer.encode(want, add_special_tokens=False)
    assert ours.eos_token_ids >= {hf_tokenizer.eos_token_id}


def test_dequantized_weights_match_transformers(real_gguf: Path, hf_model: Any) -> None:
    """The float32 weights the loader builds in memory from the GGUF (no shard is written) are transformers'."""
    cfg = hf_model.config
    theirs = hf_model.state_dict()
    seen = set()
    for name, ours in iter_dequantized(real_gguf, cfg.num_attention_heads, cfg.num_key_value_heads):
        assert ours.dtype == torch.float32, name
        np.testing.assert_allclose(ours.numpy(), theirs[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
        seen.add(name)
    assert seen == set(theirs)


def test_greedy_decoding_matches_transformers(real_engine: Any, hf_model: Any) -> None:
    prompts = [real_engine.apply_chat_template([{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]
    outs = real_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0})
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, top_p=None, top_k=None, temperature=None
            )
        want = ref[0, len(ids) :].tolist()
        assert len(want) == 32, "the reference stopped early: pick a prompt with a longer answer"
        assert out["output_ids"][:32] == want


def test_four_turn_chat_reuses_the_cache(real_engine: Any, real_model_dir: Path) -> None:
    code = (REPO / "radixserve" / "model" / "resolve.py").read_text()[:1500]
    questions = [
        f"Here is a Python module:\n```python\n{code}\n```\nWhat does `default_cache_dir` return?",
        "How is the sha256 of the assembled file checked?",
        "What does `_locked` protect against?",
        "Summarize the module in one sentence.",
    ]
    messages: list[dict[str, str]] = []
    previous = 0  # tokens of the previous turn's prompt and answer
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        ids = real_engine.apply_chat_template(messages)
        out = real_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 40, "temperature": 0})
        meta = out["meta_info"]
        if turn > 0:
            assert meta["cached_tokens"] >= 0.95 * previous, (turn, meta, previous)
        previous = meta["prompt_tokens"] + meta["completion_tokens"]
        messages.append({"role": "assistant", "content": out["text"]})


def test_cli_generate_prints_an_answer(real_model_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "generate",
            "--chat",
            "--max-new-tokens",
            "12",
            "What is the capital of France? Answer with one word.",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "prompt tokens" in proc.stderr
