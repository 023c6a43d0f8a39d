"""Chat messages -> prompt ids that keep multi-turn conversations on the radix cache.

Turn k's KV is cached for its prompt ids followed by the ids the model generated. Clients send the answer back as
text, and re-tokenizing that text often gives other ids than were generated (BPE merges the generated ids did not
follow), so a plain render-and-encode of turn k+1 would diverge from the cache right where the answer starts.

So the builder remembers, per cache namespace, each answer's text with the ids that produced it (a bounded LRU), and
renders turn k+1 in segments: the chat template's text around each remembered assistant answer is encoded, the answer
itself is replaced by its generated ids. The template is rendered a second time with a sentinel in place of each
remembered answer; the split is used only if putting the answers back into the sentinel render gives exactly the real
render (the template copied the content verbatim), otherwise the plain encoding is used. A conversation without
remembered answers encodes exactly as Engine.apply_chat_template does.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixserve.io import FinishReason
from radixserve.tokenizer import Tokenizer

_SENTINEL = "\ue000radixserve-answer-{}\ue001"  # private-use code points: never in real chat text
_SENTINEL_RE = re.compile("\ue000radixserve-answer-(\\d+)\ue001")
_MAX_TRIM = 8  # a stop string cuts the text; try dropping this many trailing ids to find the ids of the text


class ChatPromptBuilder:
    """Render chat messages into prompt ids, splicing in the generated ids of assistant answers it remembers."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._answers: OrderedDict[tuple[str, str], array] = OrderedDict()
        self._lock = threading.Lock()  # build() runs in worker threads, remember() on the event loop

    def remember(
        self,
        namespace: str,
        text: str,
        output_ids: Sequence[int],
        finish_reason: FinishReason | None,
        skip_special_tokens: bool = True,
    ) -> None:
        """Record that `output_ids` produced the answer `text` (as the engine decoded it) in this cache namespace."""
        if not text or not finish_reason or finish_reason.type == "abort":
            return
        ids = list(output_ids)
        if (
            finish_reason.type == "stop"
            and isinstance(finish_reason.matched, int)
            and ids
            and ids[-1] == finish_reason.matched
        ):
            ids.pop()  # the EOS/stop token: the template writes its own end-of-turn after the content
        trimmed = 0
        while self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) != text:
            if len(ids) <= 1 or trimmed == _MAX_TRIM:
                return  # no prefix of the ids spells the text (e.g. a stop string ended mid-token)
            ids.pop()
            trimmed += 1
        with self._lock:
            key = (namespace, text)
            self._answers[key] = array("i", ids)
            self._answers.move_to_end(key)
            while len(self._answers) > self.capacity:
                self._answers.popitem(last=False)

    def build(
        self,
        messages: list[dict[str, Any]],
        namespace: str,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids for `messages` (string contents) and `tools` plus the generation prompt; template_kwargs are
        the template's own variables (e.g. enable_thinking); ValueError from the template."""
        tok = self.tokenizer
        extra = template_kwargs or {}
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **extra)
        spliced: list[tuple[int, array]] = []  # (message index, generated ids)
        with self._lock:
            for i, m in enumerate(messages):
                if m["role"] == "assistant" and isinstance(m.get("content"), str):
                    ids = self._answers.get((namespace, m["content"]))
                    if ids is not None:
                        self._answers.move_to_end((namespace, m["content"]))
                        spliced.append((i, ids))
        if not spliced:
            return tok.encode(text, add_special_tokens=False)

        marked = [dict(m) for m in messages]
        for n, (i, _) in enumerate(spliced):
            marked[i]["content"] = _SENTINEL.format(n)
        parts = _SENTINEL_RE.split(tok.apply_chat_template(marked, add_generation_prompt=True, tools=tools, **extra))
        texts, order = parts[0::2], [int(k) for k in parts[1::2]]
        contents = [messages[i]["content"] for i, _ in spliced]
        if order != list(range(len(spliced))) or _join(texts, contents) != text:
            return tok.encode(text, add_special_tokens=False)  # the template rewrote the content: no safe split

        ids: list[int] = []
        for n, segment in enumerate(texts):
            if segment:
                ids += tok.encode(segment, add_special_tokens=False)
            if n < len(spliced):
                ids += spliced[n][1]
        return ids


def _join(texts: list[str], contents: list[str]) -> str:
    out = [texts[0]]
    for content, segment in zip(contents, texts[1:]):
        out += [content, segment]
    return "".join(out)
