"""Tool calls in the model's own format: parsing them out of generated text, whole or streamed (the grammars that
hold a model to its tools are tool_grammar.py's).

One parser per chat template family, chosen from the template's text. Qwen2.5 (and Hermes-style templates, the
test models' among them) write each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from radixserve.tokenizer import Tokenizer


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class CallList:
    """The calls of one turn as the client gets them. A small model asked for calls may go on calling (the same city
    again, or the same call over and over) until max_tokens; so the list ends at the first call that repeats an
    earlier one exactly (it and all after it are dropped), and after the first call when parallel calls are off.
    Whole and streamed parsing share this rule, so both return the same calls."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.closed = False
        self._seen: set[tuple[str, str]] = set()

    def add(self, call: ToolCall) -> bool:
        """Take the call if the list is still open; False (and the list closes) if it repeats an earlier one."""
        if self.closed:
            return False
        key = (call.name, _canonical(call.arguments))
        if key in self._seen:
            self.closed = True
            return False
        self._seen.add(key)
        self.calls.append(call)
        self.closed = not self.parallel
        return True


def _canonical(arguments: str) -> str:
    """Arguments compared by value: the same object written with other spacing or key order is the same call."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments


@dataclass
class StreamEvent:
    """What a streamed piece of text turned out to be: plain content, or one complete tool call (index-th)."""

    content: str = ""
    call: ToolCall | None = None
    index: int = 0


class HermesToolFormat:
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2.5, Hermes)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, tokenizer: Tokenizer, names: frozenset[str] = frozenset(), parallel: bool = True) -> None:
        self.tokenizer = tokenizer
        self.names = names  # the request's tool names: a JSON call outside the markers counts if it names one
        self.parallel = parallel  # parallel_tool_calls: false ends the list after its first call (CallList)

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(the content, or None if empty; the calls) of a whole output, read as ToolStream reads it streamed, so
        both find the same calls. Without calls (and not cut off), the content is the text as it is.
        `truncated` (generation ended by length): a call cut off part way is dropped, not content."""
        stream = ToolStream(self)
        events = stream.feed(text) + stream.finish(truncated)
        calls = [e.call for e in events if e.call is not None]
        if not calls and not truncated:
            return text, []
        return "".join(e.content for e in events).strip() or None, calls

    @staticmethod
    def parse_block(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Splits streamed text into content deltas and complete tool calls. A call is the model's marked block, or a
    JSON object that names one of the request's tools (what small models write instead: bare, one after another,
    or in a ```json fence, which then is no content either). Text that may begin either is held back until it is
    known not to; a call is emitted once complete (`finish` flushes what is left)."""

    def __init__(self, fmt: HermesToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text read but not yet emitted
        self.mode = "text"  # text | marked (inside the markers) | json (an object that may be a call) | fence
        self.fence = ""  # a fence's opening line held back: no content if a call follows it
        self.close_fence = False  # a call came out of a fence: the fence's closing ``` is no content
        self.after_call = False  # the whitespace that separates two calls is no content
        self.calls = CallList(fmt.parallel)

    @property
    def count(self) -> int:
        """Calls emitted so far."""
        return len(self.calls.calls)

    @property
    def closed(self) -> bool:
        """The call list has ended: nothing more will be emitted, and generation may stop."""
        return self.calls.closed

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self.buf += text
        step = {"text": self._text, "marked": self._marked, "json": self._json, "fence": self._fence}
        while not self.closed and step[self.mode](events):
            pass
        if self.closed:
            self.buf = ""
        return events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """What is left at the end; `truncated` (ended by length): a call cut off part way is dropped."""
        rest, fence, self.buf, self.fence = self.buf, self.fence, "", ""
        if self.closed:
            return []
        if truncated and (self.mode in ("marked", "json") or partial_suffix(rest, self.fmt.start) == len(rest) > 0):
            return []
        if self.close_fence and FENCE.startswith(rest.strip()):
            return []
        return [StreamEvent(content=fence + rest)] if fence + rest else []

    def _emit(self, events: list[StreamEvent], text: str) -> None:
        if text:
            events.append(StreamEvent(content=text))

    def _call(self, events: list[StreamEvent], call: ToolCall) -> None:
        if self.calls.add(call):
            events.append(StreamEvent(call=call, index=self.count - 1))
        self.after_call = True

    def _text(self, events: list[StreamEvent]) -> bool:
        """Free text: emit it up to where a call (or a fence around one) may begin."""
        if self.after_call or self.close_fence:
            self.buf = self.buf.lstrip()
            if not self.buf or (self.close_fence and FENCE.startswith(self.buf) and self.buf != FENCE):
                return False
            if self.close_fence and self.buf.startswith(FENCE):
                self.buf = self.buf[len(FENCE) :]
            self.after_call = self.close_fence = False
            return True
        starts = {"marked": self.buf.find(self.fmt.start)}
        if self.fmt.names:  # JSON calls count only when they name a declared tool
            starts.update(json=self.buf.find("{"), fence=self.buf.find(FENCE))
        found = [(pos, mode) for mode, pos in starts.items() if pos >= 0]
        if not found:
            held = max(
                partial_suffix(self.buf, m) for m in ([self.fmt.start, FENCE] if self.fmt.names else [self.fmt.start])
            )
            cut = len(self.buf) - held
            self._emit(events, self.buf[:cut])
            self.buf = self.buf[cut:]
            return False
        pos, self.mode = min(found)
        self._emit(events, self.buf[:pos])
        self.buf = self.buf[pos:]
        return True

    def _marked(self, events: list[StreamEvent]) -> bool:
        """Inside the model's markers: a call once the end marker arrives (any name: the model's own format)."""
        end = self.buf.find(self.fmt.end)
        if end < 0:
            return False
        block, self.buf, self.mode = self.buf[: end + len(self.fmt.end)], self.buf[end + len(self.fmt.end) :], "text"
        call = self.fmt.parse_block(block[len(self.fmt.start) : -len(self.fmt.end)])
        if call is None:
            self._emit(events, block)
        else:
            self._call(events, call)
        return True

    def _fence(self, events: list[StreamEvent]) -> bool:
        """A fence's opening line: held while a JSON object may follow it, content otherwise."""
        line_end = self.buf.find("\n")
        if line_end < 0:
            if len(self.buf) <= MAX_FENCE_LINE:
                return False
            line_end = len(self.buf) - 1
        head, after = self.buf[: line_end + 1], self.buf[line_end + 1 :]
        body = after.lstrip()
        if head[len(FENCE) :].strip() in ("", "json") and not body:
            return False
        if head[len(FENCE) :].strip() in ("", "json") and body.startswith("{"):
            self.fence, self.buf, self.mode = head + after[: len(after) - len(body)], body, "json"
            return True
        self._emit(events, head)
        self.buf, self.mode = after, "text"
        return True

    def _json(self, events: list[StreamEvent]) -> bool:
        """An object in free text: a call if it opens as one and names a declared tool, content otherwise."""
        head = json_head(self.buf)
        if head is None:
            return False
        end = object_end(self.buf) if head else 1
        if end is None:
            return False
        obj, self.buf, self.mode = self.buf[:end], self.buf[end:], "text"
        call = self.fmt.parse_block(obj) if head else None
        if call is not None and call.name in self.fmt.names:
            self._call(events, call)
            self.close_fence = bool(self.fence)
        else:
            self._emit(events, self.fence + obj)
        self.fence = ""
        return True


FENCE = "```"
MAX_FENCE_LINE = 16  # a fence's opening line longer than this (with no newline yet) names no JSON: content


def json_head(text: str) -> bool | None:
    """Whether text that starts with "{" opens a call object (`{"name": "`, whitespace allowed between, as the lazy
    grammar's trigger in tool_grammar.py), None while it cannot yet tell."""
    rest = text[1:]
    for piece in ('"name"', ":", '"'):
        rest = rest.lstrip(" \t\n")
        if not rest:
            return None
        if not rest.startswith(piece):
            return None if piece.startswith(rest) else False
        rest = rest[len(piece) :]
    return True


def object_end(text: str) -> int | None:
    """The index just past the JSON object that opens text (at "{"), by its brackets outside strings; None while it
    has not closed."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def tool_format(
    tokenizer: Tokenizer, names: frozenset[str] = frozenset(), parallel: bool = True
) -> HermesToolFormat | None:
    """The tool-call format of the model's chat template (for a request with tools of these names), or None when
    its template writes no tool calls."""
    template = tokenizer.select_chat_template(tools=True)
    if isinstance(template, str) and HermesToolFormat.start in template:
        return HermesToolFormat(tokenizer, names, parallel)
    return None
