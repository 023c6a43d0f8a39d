"""Incremental detokenizer: turns a stream of generated ids into UTF-8-safe text deltas and finds stop strings and
stop regexes."""

from __future__ import annotations

import re
from collections.abc import Sequence

from radixserve.tokenizer import Tokenizer

# Prompt tokens kept as left context: tokenizers whose text depends on the neighbour (SentencePiece's leading space,
# byte-level pieces of one character) decode the first generated tokens the same way a full decode would.
CONTEXT_TOKENS = 6
# A stop regex is searched in this many last characters of the text (SGLang bounds it by tokens): a match longer
# than this is not seen, and the work per token stays bounded however long the output grows.
REGEX_WINDOW = 4096


class IncrementalDetokenizer:
    """One request's streaming text: `step` per batch of new ids, `flush` once at the end; `text` is all emitted."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        stop_regex: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.stop_regex = tuple(re.compile(r) for r in stop_regex)
        self.no_stop_trim = no_stop_trim  # a matched stop string stays in the text
        self.armed = True  # whether a stop may match now (not while the request is short of its min_new_tokens)
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        # Window of ids being decoded: ids[:read] were already turned into text; ids[prefix:read] is context whose
        # text we subtract so that only the new tokens' text (as rendered next to its neighbours) comes out.
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._pending = ""  # decoded text held back because it may be the start of a stop string
        self.text = ""
        self.stopped: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _new_text(self, final: bool) -> str:
        """Text of the ids past the read offset; "" while it ends in half a UTF-8 character (unless final)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""  # an incomplete character (or nothing visible yet): wait for the next token
        # Slide the window: the next step decodes from here with the last emitted tokens as context.
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= 64:  # the window never looks before _prefix: drop those ids now and then
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return full_text[len(prefix_text) :]

    def _release(self, final: bool) -> tuple[str, str | None]:
        """Emit pending text up to the first stop match, holding back a tail that could start a stop string."""
        pending = self._pending
        if self.stop and self.armed:
            hits = [(i, s) for s in self.stop if (i := pending.find(s)) >= 0]
            if hits:
                i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
                return self._stop_at(i + len(s) if self.no_stop_trim else i, s)
        if self.stop_regex and self.armed:
            tail = (self.text[-REGEX_WINDOW:] + pending)[-REGEX_WINDOW:]
            for r in self.stop_regex:
                if r.search(tail):  # as SGLang, the text keeps what matched: up to the token that completed it
                    return self._stop_at(len(pending), r.pattern)
        hold = 0 if final else self._stop_prefix_len(pending)
        out = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        self.text += out
        return out, None

    def _stop_at(self, end: int, matched: str) -> tuple[str, str]:
        """Stop: emit pending text up to `end`, drop the rest."""
        out = self._pending[:end]
        self.stopped = matched
        self._pending = ""
        self.text += out
        return out, matched

    def _stop_prefix_len(self, s: str) -> int:
        """Length of the longest suffix of s that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(s)), 0, -1):
            tail = s[-k:]
            if any(stop.startswith(tail) for stop in self.stop):
                return k
        return 0

    def step(self, new_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed newly generated ids; return (text safe to emit now, matched stop string or None)."""
        if self.stopped is not None:
            return "", self.stopped
        self._ids.extend(new_ids)
        self._pending += self._new_text(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At finish: the held-back text (half characters included), cut before a stop string if one now matches."""
        if self.stopped is not None:
            return ""
        self._pending += self._new_text(final=True)
        out, _ = self._release(final=True)
        return out
