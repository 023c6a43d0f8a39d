"""The typed events of a streamed `/v1/responses`: each output item (reasoning, message, function call) is added,
filled by deltas and done, in OpenAI's order, every event numbered."""

from __future__ import annotations

from radixserve.server.responses_convert import call_item, message_item, reasoning_item
from radixserve.server.responses_protocol import (
    ArgsDelta,
    ArgsDone,
    FunctionCallItem,
    ItemAdded,
    ItemDone,
    MessageItem,
    OutputItem,
    OutputText,
    PartAdded,
    PartDone,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ResponseEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from radixserve.server.serving import ServerState, sse_json
from radixserve.server.tool_calls import ToolCall
from radixserve.server.turns import ReasoningDelta, TextDelta


class Emitter:
    """Writes each event as `event: <type>` + `data: <json>`, numbered; keeps the output items as streamed, with the
    one that deltas go to while it is open."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.seq = 0
        self.output: list[OutputItem] = []
        self.open: MessageItem | ReasoningItem | None = None

    def sse(self, make: type[ResponseEvent], **fields: object) -> bytes:
        event = make(sequence_number=self.seq, **fields)
        self.seq += 1
        tag = make.__struct_config__.tag
        return b"event: " + str(tag).encode() + b"\ndata: " + sse_json(self.state.json, event) + b"\n\n"

    def delta(self, ev: TextDelta | ReasoningDelta) -> list[bytes]:
        """A piece of text or reasoning, into the open item of its kind (closing one of the other kind first)."""
        thinking = isinstance(ev, ReasoningDelta)
        out = self.close() if self.open is not None and isinstance(self.open, ReasoningItem) != thinking else []
        if self.open is None:
            out += self._start(thinking)
        item, index = self.open, len(self.output) - 1
        assert item is not None
        item.content[0].text += ev.text
        kind = ReasoningDeltaEvent if thinking else TextDeltaEvent
        return out + [self.sse(kind, item_id=item.id, output_index=index, content_index=0, delta=ev.text)]

    def _start(self, thinking: bool) -> list[bytes]:
        item = reasoning_item("") if thinking else message_item("")
        self.open = item
        self.output.append(item)
        index = len(self.output) - 1
        if isinstance(item, ReasoningItem):
            return [self.sse(ItemAdded, output_index=index, item=ReasoningItem(item.id, [], status="in_progress"))]
        return [
            self.sse(ItemAdded, output_index=index, item=MessageItem(item.id, [], "in_progress")),
            self.sse(PartAdded, item_id=item.id, output_index=index, content_index=0, part=OutputText("")),
        ]

    def close(self) -> list[bytes]:
        """Finish the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = self.output.index(item), item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, ReasoningItem):
            done = [self.sse(ReasoningDoneEvent, **where, text=part.text)]
        else:
            done = [self.sse(TextDoneEvent, **where, text=part.text), self.sse(PartDone, **where, part=part)]
        return done + [self.sse(ItemDone, output_index=index, item=item)]

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        item = call_item(call.id, call.name, call.arguments)
        self.output.append(item)
        index = len(self.output) - 1
        opening = FunctionCallItem(item.id, item.call_id, item.name, "", "in_progress")
        return out + [
            self.sse(ItemAdded, output_index=index, item=opening),
            self.sse(ArgsDelta, item_id=item.id, output_index=index, delta=item.arguments),
            self.sse(ArgsDone, item_id=item.id, output_index=index, name=item.name, arguments=item.arguments),
            self.sse(ItemDone, output_index=index, item=item),
        ]
