"""Ending a generation where its tool-call list closes (tool_calls.CallList: a call that repeats an earlier one, or
the first call when `parallel_tool_calls` is false).

The engine knows nothing of tool calls, so the server reads the output as it streams, aborts the request at that
point and reports the turn as ended by its calls rather than by the abort. A turn with tools that the client does
not stream is read from the engine's stream as well: it stops at the same place, so streamed and whole answers
carry the same calls (and neither runs on to max_tokens).
"""

from __future__ import annotations

import contextlib

import msgspec
from starlette.requests import Request

from radixserve.io import FinishReason, GenerateOutput
from radixserve.server.handler import Job, accumulate, folded, start_streams
from radixserve.server.reasoning import ThinkSplit
from radixserve.server.serving import ServerState, Stream, abort_all, close_streams, merged, unless_disconnected
from radixserve.server.tool_calls import ToolFormat, StreamEvent, ToolStream

# How a turn stopped at its closed call list ends: as if the model had stopped there (no stop token matched).
CALLS_ENDED = FinishReason("stop", None)


class CallWatch:
    """One output's reader: takes its text as it streams (its answer only, past any reasoning) and says when its
    call list has closed."""

    def __init__(self, parser: ToolFormat, think: ThinkSplit | None = None) -> None:
        self.split = ToolStream(parser)
        self.think = think

    @property
    def closed(self) -> bool:
        return self.split.closed

    def feed(self, text: str) -> list[StreamEvent]:
        """Read a piece of output: what it turned out to be (content, complete calls); see `closed` after."""
        if self.think is not None:
            text = "".join(t for kind, t in self.think.feed(text) if kind == "content")
        return self.split.feed(text)


def end_at_calls(state: ServerState, stream: Stream, out: GenerateOutput) -> GenerateOutput:
    """Abort a stream whose call list closed before the engine finished it; its output as far as it was read, ended
    by CALLS_ENDED. The chunks the stream still yields (the abort's) are the caller's to ignore."""
    if not stream.finished:
        state.engine.abort(stream.rid)
    return msgspec.structs.replace(out, meta_info=msgspec.structs.replace(out.meta_info, finish_reason=CALLS_ENDED))


async def collect(request: Request, state: ServerState, job: Job, watches: list[CallWatch]) -> list[GenerateOutput]:
    """The job's outputs (one per sample, as `generate` returns them), each read from its engine stream and ended
    where its call list closes (`watches`: one per sample)."""
    streams = await start_streams(request, state, job, "messages")
    acc: list[GenerateOutput | None] = [None] * len(streams)

    async def read() -> None:
        async with contextlib.aclosing(merged(streams)) as chunks:
            async for i, c in chunks:
                if watches[i].closed:
                    continue  # stopped here already: what follows is the abort's chunk
                acc[i] = out = accumulate(acc[i], c)
                watches[i].feed(c.text)
                if watches[i].closed and c.meta_info.finish_reason is None:
                    acc[i] = end_at_calls(state, streams[i], out)

    try:
        await unless_disconnected(request, read(), on_gone=lambda: abort_all(state.engine, [s.rid for s in streams]))
    finally:
        await close_streams(state.engine, streams)
    return folded(acc)
