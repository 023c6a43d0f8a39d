"""The routing key of a request: text whose prefixes track the prefixes of the prompt the worker will compute.

The key is text, not tokens: the router does not load a tokenizer (it stays light, starts at once, and fronts workers
whatever model they serve), and a worker's token prefix grows exactly when the rendered text prefix does. A chat
request is keyed by its messages in order (role and content, with separators no text contains), which is a prefix of
the next turn's key just as the chat template's rendering is. The key starts with the cache namespace (a digest of the
API key, and cache_salt): workers never share KV across namespaces, so the router must not match across them either.
"""

from __future__ import annotations

import hashlib
from typing import Any

SEP = "\x1e"  # record separator: between messages
ROLE = "\x1f"  # unit separator: between a role and its content


def namespace(authorization: str | None, body: dict[str, Any]) -> str:
    ns = ""
    if authorization:
        ns = hashlib.sha256(authorization.encode()).hexdigest()[:16]
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        ns += "|" + salt
    return ns + SEP


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, as the server joins them
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _prompt(prompt: Any) -> str:
    """A string, token ids, or a batch of either: the first prompt (a batch lands on one worker as one request)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt) + " "  # the trailing space: "1 2" must not be a prefix of "1 23"
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(
            f"{m.get('role', '')}{ROLE}{_content(m.get('content'))}{SEP}" for m in messages if isinstance(m, dict)
        )
    if path == "/v1/completions":
        return _prompt(body.get("prompt"))
    if path == "/generate":
        return _prompt(body.get("text") if body.get("text") is not None else body.get("input_ids"))
    return ""


def routing_key(path: str, body: dict[str, Any], authorization: str | None = None) -> tuple[str, int]:
    """The key, and the length of its namespace prefix (not prompt text: match rates leave it out, or every request
    of one API key would look half cached on whichever worker saw that key first)."""
    ns = namespace(authorization, body)
    return ns + prompt_text(path, body), len(ns)
