"""Tool calls in the model's own format: parsing them out of generated text (whole or streamed), and the grammar that
makes a model call a tool when `tool_choice` asks for one.

One parser per chat template family, chosen from the template's text. Qwen2.5 (and Hermes-style templates, the
test models' among them) write each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.constrained.grammar import JSON_OPTIONS
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
        self.names = names  # the request's tool names: a bare call of one of them counts too (see bare_call)
        self.parallel = parallel  # parallel_tool_calls: false ends the list after its first call (CallList)

    def bare_call(self, text: str) -> ToolCall | None:
        """Small Qwen2.5 models often answer a call as the bare JSON object, without the markers: the whole output
        is then a call if it parses as one and names one of the request's tools."""
        body = text.strip()
        call = self.parse_block(body) if body.startswith("{") and body.endswith("}") else None
        return call if call is not None and call.name in self.names else None

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call, or None if empty; the calls). A block that does not parse stays text;
        `truncated` (generation ended by length): a call cut off before its end marker is dropped, not content.
        Once the call list closes (CallList), the rest of the text is dropped: generation was stopped there."""
        calls = CallList(self.parallel)
        if truncated:  # cut off inside the start marker itself: that was a call beginning too
            text = text[: len(text) - partial_suffix(text, self.start)]
        content, rest = text, ""
        pos = text.find(self.start)
        if pos < 0:
            bare = self.bare_call(text)
            return (None, [bare]) if bare is not None else (text, [])
        content, rest = text[:pos], text[pos:]
        leftover = []
        while rest and not calls.closed:
            if not rest.startswith(self.start):
                nxt = rest.find(self.start)
                leftover.append(rest if nxt < 0 else rest[:nxt])
                rest = "" if nxt < 0 else rest[nxt:]
                continue
            end = rest.find(self.end)
            if end < 0:
                if not truncated:
                    leftover.append(rest)
                break
            call = self.parse_block(rest[len(self.start) : end])
            if call is None:
                leftover.append(rest[: end + len(self.end)])
            else:
                calls.add(call)
            rest = rest[end + len(self.end) :]
        text_out = (content + "".join(s for s in leftover if s.strip())).strip()
        return (text_out or None), calls.calls

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

    def grammar(
        self, tools: list[dict[str, Any]], choice: str | None, parallel: bool = True, answer: dict | None = None
    ) -> str:
        """A Lark grammar (llguidance's dialect) for one call of `choice` (a function name), or for one call of any
        tool (`choice` None: tool_choice "required"), or several with `parallel`. Markers that are single tokens in the vocabulary
        are named by id, so the grammar matches the token the model emits, not its spelling."""
        chosen = [t["function"] for t in tools if choice is None or t["function"]["name"] == choice]
        schemas = []
        for i, fn in enumerate(chosen):
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            # The parameters sit under the wrapper's properties.arguments: their own "#/..." refs ($defs of nested
            # pydantic models, "#" for recursion) must point there, not at the wrapper's root.
            where = "#/properties/arguments" if len(chosen) == 1 else f"#/anyOf/{i}/properties/arguments"
            schemas.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, "arguments": rebase_refs(params, where)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, **{"x-guidance": JSON_OPTIONS})
        call = f'{self._marker(self.start)} "\\n" body "\\n" {self._marker(self.end)}'
        # After each complete call the model may end: also after the newline that would begin another one (with the
        # call marker then the only text left, jump-forward would force a next call, and small models went on
        # calling, city after city, until max_tokens).
        repeat = ' ("\\n" call)* "\\n"?' if choice is None and parallel else ""
        rules = f"call: {call}\nbody: %json {json.dumps(schema)}\n"
        if answer is None:
            return f"start: call{repeat}\n" + rules
        # `answer`: the schema of a text answer (response_format), applied to that answer only, a call staying open
        answer_schema = json.dumps(dict(answer, **{"x-guidance": JSON_OPTIONS}))
        return f"start: call{repeat} | answer\n" + rules + f"answer: %json {answer_schema}\n"

    def _marker(self, text: str) -> str:
        tid = self.tokenizer.token_to_id(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)


class ToolStream:
    """Splits streamed text into content deltas and complete tool calls: text that may begin a call marker is held
    back until it is known not to; a call is emitted when its end marker arrives (`finish` flushes what is left)."""

    def __init__(self, fmt: HermesToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.in_call = False
        self.after_call = False  # the newline that separates two calls is no content
        self.bare = False  # the output began with "{": held back whole, it may be a bare call (see bare_call)
        self.started = False
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
        if self.closed:
            return []
        self.buf += text
        if not self.started and self.buf.strip():
            self.started, self.bare = True, self.buf.lstrip().startswith("{") and bool(self.fmt.names)
        if self.bare:
            return []
        events: list[StreamEvent] = []
        while True:
            if not self.in_call:
                if self.after_call:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return events
                    self.after_call = False
                pos = self.buf.find(self.fmt.start)
                if pos < 0:
                    keep = partial_suffix(self.buf, self.fmt.start)
                    cut = len(self.buf) - keep
                    if cut:
                        events.append(StreamEvent(content=self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    return events
                if pos:
                    events.append(StreamEvent(content=self.buf[:pos]))
                self.buf, self.in_call = self.buf[pos:], True
            end = self.buf.find(self.fmt.end)
            if end < 0:
                return events
            block = self.buf[: end + len(self.fmt.end)]
            call = self.fmt.parse_block(block[len(self.fmt.start) : -len(self.fmt.end)])
            if call is None:
                events.append(StreamEvent(content=block))
            elif self.calls.add(call):
                events.append(StreamEvent(call=call, index=self.count - 1))
            self.buf = self.buf[end + len(self.fmt.end) :]
            self.in_call, self.after_call = False, call is not None
            if self.closed:
                self.buf = ""
                return events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """What is left at the end; `truncated` (ended by length): a call cut off inside its markers is dropped."""
        rest, self.buf = self.buf, ""
        if self.closed:
            return []
        if truncated and (self.in_call or (rest and partial_suffix(rest, self.fmt.start) == len(rest))):
            return []
        if self.bare:
            call = self.fmt.bare_call(rest)
            if call is not None and self.calls.add(call):
                return [StreamEvent(call=call, index=0)]
        return [StreamEvent(content=rest)] if rest else []


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


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#", "#/$defs/X", ...) are resolved from `base` (a JSON pointer
    fragment where the schema is embedded in a larger document) instead of the document's root."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out
