"""Tokenizer: a `tokenizers` model plus the Hugging Face config around it (special tokens, BOS rule, chat template)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict with "content"."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for serving it just renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters and sorts keys; chat templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does: sandboxed, trim_blocks + lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes were
    moved, in order, to code points 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(moved)}


# Names a message's reasoning comes under; templates read "reasoning_content" (most) or "thinking" (gpt-oss).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _content_text(content: Any) -> Any:
    """OpenAI content parts -> one string (text parts joined by newlines); strings and None pass through."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}: only text parts are supported")
    return "\n".join(texts)


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(
        self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None, extra_eos_ids: Sequence[int] = ()
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; config is tokenizer_config.json as a dict (specials, chat_template, BOS)."""
        config = config or {}
        self._tok = tokenizer
        self.config = config
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.pad_token: str | None = _token_str(config.get("pad_token"))
        self.unk_token: str | None = _token_str(config.get("unk_token"))
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        eos_ids = {i for i in extra_eos_ids if 0 <= i < self.vocab_size}
        if eos_id is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        if self.eos_token is None and self.eos_token_ids:
            self.eos_token = self.id_to_token(min(self.eos_token_ids))

        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        for i, t in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(t, dict) and t.get("special"):
                special.add(int(i))
        if self.bos_token_id is not None:
            special.add(self.bos_token_id)
        self.special_token_ids: frozenset[int] = frozenset(special | eos_ids)

        # BOS: tokenizer.json's post-processor may add it (Llama 3, Mistral). An explicit add_bos_token wins, as
        # transformers' Llama tokenizers rebuild the post-processor from it; absent, the post-processor decides.
        post_ids = tokenizer.encode("", add_special_tokens=True).ids
        bos_rule = config.get("add_bos_token")
        if self.bos_token_id is None or bos_rule is None:
            self.add_bos_token: bool = bool(post_ids) and post_ids[0] == self.bos_token_id
        else:
            self.add_bos_token = bool(bos_rule)
        self._strip_post_bos = (
            not self.add_bos_token
            and self.bos_token_id is not None
            and bool(post_ids)
            and post_ids[0] == self.bos_token_id
        )
        self.add_eos_token: bool = bool(config.get("add_eos_token", False)) and eos_id is not None
        self._eos_id = eos_id
        self.chat_template: str | dict[str, str] | None = self._parse_templates(config.get("chat_template"))
        # the decoder's own JSON (its pickle state), not the whole tokenizer's: that can be tens of megabytes
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self._byte_level = "ByteLevel" in kinds
        self._byte_decoder = _byte_decoder() if self._byte_level else {}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja, eos ids of generation_config/config)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        # Newer transformers save the template beside the config instead of inside it.
        if (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif "chat_template" not in config and (path / "chat_template.json").is_file():
            config["chat_template"] = _read_json(path / "chat_template.json").get("chat_template")
        extra_eos = _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        extra_eos += _ids(_read_json(path / "config.json").get("eos_token_id"))
        return cls(tok, config, extra_eos)

    @staticmethod
    def _parse_templates(value: Any) -> str | dict[str, str] | None:
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            return {t["name"]: t["template"] for t in value}
        return value if isinstance(value, (str, dict)) else None

    # ---- ids <-> text ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; with add_special_tokens, the post-processor's tokens and BOS/EOS as the config says."""
        # encode_batch lets go of the GIL while it works (encode does not): a megabyte prompt takes ~0.5 s, which
        # would otherwise stall every other thread, the server's event loop and the engine loop among them.
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            if self._strip_post_bos and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and (not ids or ids[-1] != self._eos_id):
                ids = [*ids, self._eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; special tokens dropped when skip_special_tokens."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The `tokenizers` model as tokenizer.json text (grammar libraries build their vocabulary tries from it)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary token (its raw, e.g. byte-level, form), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Raw vocabulary form of an id, or None when out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_str(self, token_id: int) -> str:
        """Readable text of a single token (may hold U+FFFD when the token is part of a multi-byte character)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a part of a UTF-8 character stays a part), e.g. for OpenAI logprobs."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if token_id in self.special_token_ids:
            return token.encode()
        if self._byte_level and all(c in self._byte_decoder for c in token):
            return bytes(self._byte_decoder[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode()  # SentencePiece marks spaces with U+2581

    # ---- chat -----------------------------------------------------------------------------------------------------

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """The named special tokens a chat template may use (None where the model has none)."""
        return {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }

    def select_chat_template(self, tools: bool = False) -> str | None:
        """The template to render: of a named set, "tool_use" when tools are passed and it exists, else "default"."""
        template = self.chat_template
        if isinstance(template, dict):
            return template.get("tool_use") if tools and "tool_use" in template else template.get("default")
        return template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template (as transformers renders it); ValueError on bad input."""
        template = self.select_chat_template(bool(tools))
        if not template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        chat = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"each message must be an object with a 'role', got {m!r}")
            m = {**m, "content": _content_text(m["content"])} if "content" in m else dict(m)
            # as transformers does: reasoning sent under any of its names reaches templates under each of them
            reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        # Like transformers, only the special tokens the model has are defined (templates test `bos_token is defined`).
        variables = {k: v for k, v in self.special_tokens.items() if v is not None} | {"documents": None} | kwargs
        try:
            return _compile_template(template).render(
                messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, IndexError) as e:
            # a template refusing the conversation (raise_exception) or tripping on its shape is the caller's error
            raise ValueError(f"chat template error: {e}") from e
