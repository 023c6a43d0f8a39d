"""One assistant turn through the Chat Completions path, for the APIs converted to it (Responses, Messages).

Both convert their request into a ChatCompletionRequest, so the chat template, prompt splicing (chat_prompt.py),
grammars for tools and JSON schemas, and the tool-call parser (tool_calls.py) are the ones Chat Completions uses;
this module runs that request and hands back API-neutral results (a Turn, or stream events) for each API to render.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from radixserve.io import GenerateOutput
from radixserve.server.chat_api import Structure, prepare_chat
from radixserve.server.openai_api import Job, accumulate, finish_reason, observe_and_remember, start_streams, usage
from radixserve.server.protocol import ChatCompletionRequest, Usage
from radixserve.server.serving import ServerState, Stream, close_streams, engine_errors, generate, merged
from radixserve.server.tool_calls import ToolCall, ToolStream


@dataclass
class Turn:
    """What the model answered: its text (None when it only called tools), its tool calls, why it stopped (stop,
    length or tool_calls) and the token counts (prompt, completion, cached prompt tokens)."""

    text: str | None
    calls: list[ToolCall]
    reason: str
    usage: Usage
    new_cached: int = 0  # prompt tokens computed now that the cache keeps (whole pages past the cached prefix)


@dataclass
class TextDelta:
    text: str


@dataclass
class CallDone:
    """One complete tool call (the parser emits a call once its end marker arrives)."""

    call: ToolCall
    index: int


@dataclass
class TurnStream:
    """A streamed turn whose engine stream is open (bad input has failed already): `events()` yields TextDelta and
    CallDone, and `turn` holds the whole Turn once they end."""

    state: ServerState
    job: Job
    shape: Structure
    streams: list[Stream]
    turn: Turn | None = field(default=None)

    async def events(self) -> AsyncIterator[TextDelta | CallDone]:
        split = ToolStream(self.shape.parser) if self.shape.parser is not None else None
        acc: GenerateOutput | None = None
        try:
            async with contextlib.aclosing(merged(self.streams)) as chunks:
                async for _, c in chunks:
                    acc = accumulate(acc, c)
                    done = finish_reason(c.meta_info.finish_reason) is not None
                    if split is None:
                        if c.text:
                            yield TextDelta(c.text)
                        continue
                    for ev in split.feed(c.text) + (split.finish() if done else []):
                        if ev.call is not None:
                            yield CallDone(ev.call, ev.index)
                        elif ev.content:
                            yield TextDelta(ev.content)
        finally:
            await close_streams(self.state.engine, self.streams)
        assert acc is not None
        self.turn = _turn(self.state, self.job, self.shape, acc)


async def run_turn(request: Request, state: ServerState, req: ChatCompletionRequest, rid: str) -> Turn:
    """Generate the whole turn (the client waits for the body)."""
    job, shape = await prepare_chat(request, state, req, rid)
    with engine_errors("messages", {"max_new_tokens": job.max_param, **job.renames}):
        [[out]] = await generate(request, state, job.calls)
    return _turn(state, job, shape, out)


async def open_turn(request: Request, state: ServerState, req: ChatCompletionRequest, rid: str) -> TurnStream:
    """Open the turn's engine stream: errors in the input raise here, before the response's first byte."""
    job, shape = await prepare_chat(request, state, req, rid)
    streams = await start_streams(request, state, job, "messages")
    return TurnStream(state, job, shape, streams)


def _turn(state: ServerState, job: Job, shape: Structure, out: GenerateOutput) -> Turn:
    reason = finish_reason(out.finish_reason) or "stop"
    content, calls = (out.text, []) if shape.parser is None else shape.parser.parse(out.text)
    if calls and reason == "stop":
        reason = "tool_calls"
    observe_and_remember(state, job, [out], chat=True)
    use = usage([out], 1)
    return Turn(content, calls, reason, use, _new_cached(state, use))


def _new_cached(state: ServerState, use: Usage) -> int:
    """Prompt tokens this turn wrote to the cache: the tree keeps whole pages, so those past the cached prefix."""
    config = state.engine.config
    if not config.enable_radix_cache:
        return 0
    kept = use.prompt_tokens // config.page_size * config.page_size
    return max(0, kept - use.prompt_tokens_details.cached_tokens)
