"""One assistant turn through the Chat Completions path, for the APIs converted to it (Responses, Messages).

Both convert their request into a ChatCompletionRequest, so the chat template, prompt splicing (chat_prompt.py),
grammars for tools and JSON schemas, and the tool-call parser (tool_calls.py) are the ones Chat Completions uses;
this module runs that request (its job built and run by chat_job.py) and hands back API-neutral results (a Turn, or
stream events) for each API to render.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from starlette.requests import Request

from radixserve.errors import RequestFailedError
from radixserve.io import GenerateOutput, StreamChunk
from radixserve.server.agent_retention import retain_turn
from radixserve.server.errors import ApiError
from radixserve.server.call_stop import answer_after_echo, end_at_calls
from radixserve.server.chat_job import Structure, prepare_chat, prompt_ids, run_chat, thinking
from radixserve.server.handler import Job, accumulate, finish_reason, observe_and_remember, start_streams, usage
from radixserve.server.protocol import ChatCompletionRequest, Usage
from radixserve.server.reasoning import ThinkSplit, pieces, split_reasoning
from radixserve.server.serving import ServerState, Stream, close_streams, in_band, merged
from radixserve.server.tool_calls import ToolCall, ToolStream


@dataclass
class Turn:
    """What the model answered: its text (None when it only called tools), its tool calls, why it stopped (stop,
    length or tool_calls) and the token counts (prompt, completion, cached prompt tokens)."""

    text: str | None
    calls: list[ToolCall]
    reason: str
    usage: Usage
    stop_string: str | None = None  # the stop string that ended it, if one did
    reasoning: str | None = None  # a thinking model's reasoning (reasoning.py), apart from the text


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class CallDone:
    """One complete tool call (the parser emits a call once its end marker arrives)."""

    call: ToolCall
    index: int


@dataclass
class TurnStream:
    """A streamed turn whose engine stream is open (bad input has failed already): `events()` yields TextDelta and
    CallDone, and `turn` holds the whole Turn once they end; `close()` must follow, whatever happened."""

    state: ServerState
    job: Job
    shape: Structure
    streams: list[Stream]
    turn: Turn | None = field(default=None)

    async def events(self) -> AsyncIterator[TextDelta | ReasoningDelta | CallDone]:
        split = ToolStream(self.shape.parser) if self.shape.parser is not None else None
        think = thinking(self.state, self.job)
        acc: GenerateOutput | None = None
        async with contextlib.aclosing(self._chunks(split, think, lambda: acc)) as chunks:
            async for c in chunks:
                fin = c.meta_info.finish_reason
                if fin is not None and fin.type == "error":  # failed in the engine: in-band, never its message
                    raise in_band(RequestFailedError(c.meta_info.id))
                acc = accumulate(acc, c)
                done = finish_reason(fin) is not None
                for kind, text in pieces(think, c.text, done):
                    if kind == "reasoning":
                        yield ReasoningDelta(text)
                    elif split is None:
                        yield TextDelta(text)
                    else:
                        for ev in split.feed(text):
                            yield CallDone(ev.call, ev.index) if ev.call is not None else TextDelta(ev.content)
                for ev in split.finish() if split is not None and done else []:
                    yield CallDone(ev.call, ev.index) if ev.call is not None else TextDelta(ev.content)
                if split is not None and split.closed and not done:  # its call list closed: stop there
                    acc = end_at_calls(self.state, self.streams[0], acc)
                    break
        assert acc is not None
        self.turn = _turn(self.state, self.job, self.shape, acc)

    async def _chunks(
        self, split: ToolStream | None, think: ThinkSplit | None, out: Callable[[], GenerateOutput | None]
    ) -> AsyncIterator[StreamChunk]:
        """The engine stream's chunks; then, if the turn only repeated calls already answered (`split` has read
        it all by then; `out()` is what it came to), those of the turn asked again (call_stop.answer_after_echo)."""
        async with contextlib.aclosing(merged(self.streams)) as chunks:
            async for _, c in chunks:
                yield c
        done = out()
        if split is None or think is not None or not split.echo_only or done is None:
            return
        if done.finish_reason is not None and done.finish_reason.type == "stop":
            async with contextlib.aclosing(answer_after_echo(self.state, self.job, 0, done)) as more:
                async for c in more:
                    yield c

    async def close(self) -> None:
        """Abort what has not finished (idempotent): the caller's event generator calls it in its `finally`, which
        runs even when the client leaves before the first event."""
        await close_streams(self.state.engine, self.streams)


async def run_turn(
    request: Request, state: ServerState, req: ChatCompletionRequest, rid: str, names: dict[str, str]
) -> Turn:
    """Generate the whole turn (the client waits for the body). names: a chat or engine field -> the client's name
    for it, so errors name the field the client sent (e.g. messages -> input, json_schema -> text.format)."""
    with client_names(names):
        job, shape = await prepare_chat(request, state, req, rid)
        job.renames.update(names)
        [out] = await run_chat(request, state, job, shape)
    return _turn(state, job, shape, out)


async def open_turn(
    request: Request, state: ServerState, req: ChatCompletionRequest, rid: str, names: dict[str, str]
) -> TurnStream:
    """Open the turn's engine stream: errors in the input raise here, before the response's first byte."""
    with client_names(names):
        job, shape = await prepare_chat(request, state, req, rid)
        job.renames.update(names)
        streams = await start_streams(request, state, job, "messages")
    return TurnStream(state, job, shape, streams)


@contextlib.contextmanager
def client_names(names: dict[str, str]) -> Iterator[None]:
    """Rename the first segment of an error's param from the chat request's field to the client's."""
    try:
        yield
    except ApiError as err:
        head = _HEAD.match(err.param or "")
        if head is not None and head.group(1) in names:
            err.param = names[head.group(1)] + (err.param or "")[head.end() :]
        raise


_HEAD = re.compile(r"^([a-z_]+)")


def _turn(state: ServerState, job: Job, shape: Structure, out: GenerateOutput) -> Turn:
    reason = finish_reason(out.finish_reason) or "stop"
    think = thinking(state, job)
    reasoning, answer = ("", out.text) if think is None else split_reasoning(out.text, think)
    content, calls = (answer, []) if shape.parser is None else shape.parser.parse(answer)
    if calls and reason == "stop":
        reason = "tool_calls"
    retain_turn(state, job, out, [c.id for c in calls])
    observe_and_remember(state, job, [out], chat=True)
    fin = out.finish_reason
    matched = fin.matched if fin is not None and fin.stopped_on_string else None
    return Turn(content, calls, reason, usage([out], 1), matched, reasoning or None)  # type: ignore[arg-type]


def cache_written(state: ServerState, prompt_tokens: int, cached_tokens: int) -> int:
    """Prompt tokens a turn wrote to the cache: the tree keeps whole pages, so those past the cached prefix."""
    config = state.engine.config
    if not config.enable_radix_cache:
        return 0
    return max(0, prompt_tokens // config.page_size * config.page_size - cached_tokens)


async def count_prompt(request: Request, state: ServerState, req: ChatCompletionRequest, names: dict[str, str]) -> int:
    """The prompt's length in tokens, as the turn would build it (for /v1/messages/count_tokens)."""
    with client_names(names):
        ids, _, _ = await prompt_ids(request, state, req)
    return len(ids)
