"""Tool calls in the model's own format: parsing them out of generated text, whole or streamed (the grammars that
hold a model to its tools are tool_grammar.py's).

One format per chat template family (Family), chosen by the marker the template's text writes: Qwen2.5/Qwen3 and
Hermes-style `<tool_call>` blocks, Llama 3.x JSON objects, Mistral's `[TOOL_CALLS]` array.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from radixserve.server.json_scan import json_head, value_end
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
    A call that repeats one the conversation's last assistant turn made, whose result has come back (`answered`),
    is dropped alone: small models echo the call before answering from its result, and reading the echo as a new
    call sent agents round the same call forever. Whole and streamed parsing share these rules, so both return the
    same calls."""

    def __init__(self, parallel: bool, answered: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.parallel = parallel
        self.answered = answered
        self.calls: list[ToolCall] = []
        self.closed = False
        self.echoes = 0  # answered calls dropped
        self._seen: set[tuple[str, str]] = set()

    def add(self, call: ToolCall) -> bool:
        """Take the call if the list is still open; False if it is an echo, or (and the list closes) if it repeats
        an earlier one."""
        if self.closed:
            return False
        key = call_key(call.name, call.arguments)
        if key in self.answered:
            self.echoes += 1
            return False
        if key in self._seen:
            self.closed = True
            return False
        self._seen.add(key)
        self.calls.append(call)
        self.closed = not self.parallel
        return True


def call_key(name: str, arguments: str) -> tuple[str, str]:
    """What makes two calls the same call: the name, and the arguments by value (other spacing or key order is
    the same object)."""
    return name, _canonical(arguments)


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


@dataclass(frozen=True)
class Family:
    """How one family of chat templates writes tool calls: the marker before a call (or before the list of calls),
    the marker after each call ("" where the JSON's own end closes it), the key of the arguments, and whether the
    calls come as one JSON array after the marker."""

    name: str
    start: str
    end: str
    key: str = "arguments"
    listed: bool = False
    signs: tuple[str, ...] = ()  # text in a template that marks the family, besides its start marker


# Qwen2.5, Qwen3 and Hermes-style templates (the test models' among them): one marked block per call.
HERMES = Family("hermes", "<tool_call>", "</tool_call>")
# Llama 3.1-3.3: a bare JSON object (its "parameters" key), or one after <|python_tag|>.
LLAMA3 = Family("llama3", "<|python_tag|>", "", key="parameters", signs=('"parameters": ',))
# Mistral: [TOOL_CALLS] and then a JSON array of all the turn's calls.
MISTRAL = Family("mistral", "[TOOL_CALLS]", "", listed=True)
FAMILIES = (MISTRAL, HERMES, LLAMA3)  # each found by its marker in the template's text, in this order


class ToolFormat:
    """A family's tool-call format, for one request: its tool names (a JSON call outside the markers counts if it
    names one of them) and whether it may call several tools."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        names: frozenset[str] = frozenset(),
        parallel: bool = True,
        family: Family = HERMES,
        answered: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.names = names
        self.answered = answered  # call_key()s of the calls whose results the request sends back (CallList)
        self.parallel = parallel  # parallel_tool_calls: false ends the list after its first call (CallList)
        self.family = family
        self.start, self.end = family.start, family.end

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(the content, or None if empty; the calls) of a whole output, read as ToolStream reads it streamed, so
        both find the same calls. Without calls (and not cut off), the content is the text as it is.
        `truncated` (generation ended by length): a call cut off part way is dropped, not content."""
        stream = ToolStream(self)
        events = stream.feed(text) + stream.finish(truncated)
        calls = [e.call for e in events if e.call is not None]
        if not calls and not truncated and not stream.calls.echoes:
            return text, []
        return "".join(e.content for e in events).strip() or None, calls

    @staticmethod
    def parse_block(body: str) -> ToolCall | None:
        """One call object's JSON text as a call (its arguments under "arguments" or "parameters"), or None."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        return _call(obj)

    def parse_marked(self, value: str) -> list[ToolCall] | None:
        """The calls in the JSON after a marker with no end marker of its own (an array of them where the family
        lists its calls), or None if it holds none."""
        try:
            obj = json.loads(value)
        except json.JSONDecodeError:
            return None
        calls = [_call(o) for o in (obj if self.family.listed and isinstance(obj, list) else [obj])]
        return [c for c in calls if c is not None] if calls and None not in calls else None


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Splits streamed text into content deltas and complete tool calls. A call is the model's marked block, or a
    JSON object that names one of the request's tools (what small models write instead: bare, one after another,
    or in a ```json fence, which then is no content either). Text that may begin either is held back until it is
    known not to; a call is emitted once complete (`finish` flushes what is left)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""  # text read but not yet emitted
        # text | marked (after a marker) | listed (in an array of calls) | json (an object that may be a call) | fence
        self.mode = "text"
        self.fence = ""  # a fence's opening line held back: no content if a call follows it
        self.close_fence = False  # a call came out of a fence: the fence's closing ``` is no content
        self.after_call = False  # the whitespace that separates two calls is no content
        self.said = False  # some content other than blank space was emitted
        self.calls = CallList(fmt.parallel, fmt.answered)

    @property
    def count(self) -> int:
        """Calls emitted so far."""
        return len(self.calls.calls)

    @property
    def closed(self) -> bool:
        """The call list has ended: nothing more will be emitted, and generation may stop."""
        return self.calls.closed

    @property
    def echo_only(self) -> bool:
        """All the turn wrote (so far) is calls the conversation had answered already: no answer, no new call."""
        return self.calls.echoes > 0 and not self.calls.calls and not self.said

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self.buf += text
        step = {
            "text": self._text,
            "marked": self._marked,
            "listed": self._listed,
            "json": self._json,
            "fence": self._fence,
        }
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
        if truncated and (
            self.mode in ("marked", "listed", "json") or partial_suffix(rest, self.fmt.start) == len(rest) > 0
        ):
            return []
        if self.close_fence and FENCE.startswith(rest.strip()):
            return []
        events: list[StreamEvent] = []
        self._emit(events, fence + rest)
        return events

    def _emit(self, events: list[StreamEvent], text: str) -> None:
        if text:
            events.append(StreamEvent(content=text))
            self.said = self.said or not text.isspace()

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
        """After the model's marker: its calls once complete (any name: the model's own format)."""
        if not self.fmt.end:
            return self._marked_json(events)
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

    def _marked_json(self, events: list[StreamEvent]) -> bool:
        """A marker whose JSON (an object, or the family's array of calls) closes the call by its own end."""
        after = self.buf[len(self.fmt.start) :]
        body = after.lstrip()
        if not body:
            return False
        if self.fmt.family.listed and body[0] == "[":  # each call as soon as its object closes (see _listed)
            self.buf, self.mode = body[1:], "listed"
            return True
        end = value_end(body) if body[0] == "{" else 0
        if end is None:
            return False
        calls = self.fmt.parse_marked(body[:end]) if end else None
        self.mode = "text"
        if calls is None:  # no call after all: the marker (and what follows it) is text
            self._emit(events, self.fmt.start)
            self.buf = after
            return True
        self.buf = body[end:]
        for call in calls:
            self._call(events, call)
        return True

    def _listed(self, events: list[StreamEvent]) -> bool:
        """Inside the family's array of calls: each call once its object closes, so that the list rule (CallList)
        can end it part way, and a list cut off keeps its complete calls."""
        body = self.buf.lstrip(" \t\n,")
        self.buf = body
        if not body:
            return False
        if body[0] != "{":  # the array's end (or something that is no call: text from here)
            self.buf, self.mode = body[1:] if body[0] == "]" else body, "text"
            return True
        end = value_end(body)
        if end is None:
            return False
        call, self.buf = self.fmt.parse_block(body[:end]), body[end:]
        if call is None:
            self._emit(events, body[:end])
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
        end = value_end(self.buf) if head else 1
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


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def tool_format(
    tokenizer: Tokenizer,
    names: frozenset[str] = frozenset(),
    parallel: bool = True,
    answered: frozenset[tuple[str, str]] = frozenset(),
) -> ToolFormat | None:
    """The tool-call format of the model's chat template (for a request with tools of these names, sending back the
    results of the `answered` calls), or None when its template writes no tool calls."""
    template = tokenizer.select_chat_template(tools=True)
    for family in FAMILIES if isinstance(template, str) else ():
        if any(sign in template for sign in (family.start, *family.signs)):
            return ToolFormat(tokenizer, names, parallel, family, answered)
    return None
