"""A tiny Qwen2-like byte-level BPE tokenizer, trained deterministically at test time so no test needs the hub."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2's pre-tokenizer split: contractions, letters, single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A ChatML template in the shape of Qwen2.5's: a default system prompt, optional tools, tool calls and tool replies.
CHAT_TEMPLATE = """\
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou can call these functions:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nAnswer a call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('a system message is only allowed first') }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] %}
            {{- message['content'] }}
        {%- endif %}
        {%- for call in message.get('tool_calls') or [] %}
            {%- set fn = call['function'] if call['function'] is defined else call %}
            {{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}
            {%- if fn['arguments'] is string %}
                {{- fn['arguments'] }}
            {%- else %}
                {{- fn['arguments'] | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Training text: English prose, Python code, CJK, accented Latin, Cyrillic and emoji, so merges cover multi-byte UTF-8.
SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.",
    "Hello, world! How are you today? I'm fine, thanks. We'll see what they've done with it.",
    "A radix tree stores prefixes of token sequences so that shared prompts reuse cached keys and values.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for i in range(10):\n    print(f"value {i} = {i * i}")\n',
    "import torch\nx = torch.zeros(3, 4)\ny = x.sum(dim=-1)\n",
    "class Node:\n    def __init__(self, key):\n        self.key = key\n        self.children = {}\n",
    "你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和自然语言处理很有意思。",
    "日本語のテキストも少し含めます。東京は大きな都市です。ありがとうございます。",
    "한국어 문장도 있습니다. 감사합니다.",
    "Привет, мир! Как дела? Всё хорошо.",
    "Café, naïve, résumé, façade, Straße, smörgåsbord.",
    "Emoji: 😀 😃 😄 🎉 🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦 and more 🤖🧠.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 3.14159 2024-01-01 100%",
    "Symbols: {}[]()<>=+-*/\\|&^%$#@!~`'\";:,.?",
] * 4


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    """Train the tiny tokenizer into out_dir (tokenizer.json + tokenizer_config.json); vocab <= vocab_size."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),  # specials are added after training, at the end of the vocab
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE_TEXT, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    tok.save(str(out_dir / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out_dir
