"""Ending a generation where its tool-call list closes (tool_calls.CallList: a call that repeats an earlier one, or
the first call when `parallel_tool_calls` is false).

The engine knows nothing of tool calls, so the server reads the output as it streams, aborts the request at that
point and reports the turn as ended by its calls rather than by the abort. A turn with tools that the client does
not stream is read from the engine's stream as well: it stops at the same place, so streamed and whole answers
carry the same calls (and neither runs on to max_tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
from starlette.requests import Request

from radixserve.io import FinishReason, GenerateOutput, StreamChunk
from radixserve.server.handler import Job, accumulate, folded, start_streams
from radixserve.server.quotas import charge
from radixserve.server.reasoning import ThinkSplit
from radixserve.server.serving import (
    ServerState,
    Stream,
    abort_all,
    close_streams,
    merged,
    tokenized,
    unless_disconnected,
)
from radixserve.server.tool_calls import ToolFormat, StreamEvent, ToolStream
from radixserve.server.tool_grammar import answer_grammar
from radixserve.tokenizer import Tokenizer

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

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """What the reader still held, once the output has ended (ToolStream.finish)."""
        return self.split.finish(truncated)

    @property
    def echo_only(self) -> bool:
        """The ended output only repeated calls whose results the request sends back (a reasoning model's turn,
        whose answer grammar would have to follow its reasoning, is left as it is)."""
        return self.think is None and self.split.echo_only


def end_at_calls(state: ServerState, stream: Stream, out: GenerateOutput) -> GenerateOutput:
    """Abort a stream whose call list closed before the engine finished it; its output as far as it was read, ended
    by CALLS_ENDED. The chunks the stream still yields (the abort's) are the caller's to ignore."""
    if not stream.finished:
        state.engine.abort(stream.rid)
    return msgspec.structs.replace(out, meta_info=msgspec.structs.replace(out.meta_info, finish_reason=CALLS_ENDED))


MAX_HEADER = 8  # tokens: a turn header longer than this is no header (the prompt's own last messages)


def _continued(tok: Tokenizer, prompt: list[int], out: GenerateOutput) -> list[int]:
    """The prompt for the answer: the turn's prompt and echo, then, where the model's stop token ended the echo and
    the prompt holds that token too, the prompt's tail after it (the template's next assistant header:
    `\n<|im_start|>assistant\n` in Qwen's), so the answer is a turn of its own; else the echo without its stop
    token and a blank line. (The default model, asked on after a blank line, described its call, "This response
    provides information about ...", rather than answer from the result, and the next turn copied that.)"""
    echo = list(out.output_ids)
    stop = out.finish_reason.matched if out.finish_reason is not None else None
    if echo and echo[-1] == stop:
        if stop in prompt:
            tail = prompt[len(prompt) - prompt[::-1].index(stop) :]
            if 0 < len(tail) <= MAX_HEADER:
                return prompt + echo + tail
        echo.pop()
    return prompt + echo + tok.encode("\n\n", add_special_tokens=False)


async def answer_after_echo(
    state: ServerState, job: Job, sample: int, out: GenerateOutput
) -> AsyncIterator[StreamChunk]:
    """The turn of `out` (sample `sample` of the job), which only repeated calls the conversation had answered,
    continued: the prompt is the turn's prompt and echo (all in the cache) and what starts an answer after them
    (`_continued`), under an answer grammar (no call can start). Its chunks are counted on from `out`'s, so that a
    reader takes them as the rest of the same output. Small models echo the call before answering from its result
    and then stop; the echo is dropped (CallList), which left the turn with no answer at all. (Asked again from the
    prompt alone, the default model wrote filler.) Nothing is yielded if `out` used up its tokens."""
    call = job.calls[sample // job.n]
    left = call.sampling_params.get("max_new_tokens", 0) - out.meta_info.completion_tokens
    if left <= 0 or call.input_ids is None:
        return
    eng, base = state.engine, out.meta_info
    ids = _continued(eng.tokenizer, list(call.input_ids), out)
    params = dict(call.sampling_params, n=1, max_new_tokens=left, ebnf=answer_grammar())
    again = replace(call, input_ids=ids, sampling_params=params, rid=f"{call.rid}-answer-{sample}")
    chunks = eng.stream(await tokenized(eng, again))
    finished = False
    try:
        async for c in chunks:
            meta = c.meta_info
            finished = meta.finish_reason is not None
            # the client's prompt was counted (and cached) once, with the echo; the output tokens add up
            shown = msgspec.structs.replace(
                meta,
                id=base.id,
                prompt_tokens=base.prompt_tokens,
                cached_tokens=base.cached_tokens,
                completion_tokens=base.completion_tokens + meta.completion_tokens,
            )
            if finished:
                charge(meta.completion_tokens)
            yield msgspec.structs.replace(c, meta_info=shown)
    finally:
        if not finished:
            eng.abort(again.rid)
        await chunks.aclose()  # type: ignore[attr-defined]


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
        for i, watch in enumerate(watches):
            watch.finish()
            out = acc[i]
            if (
                watch.echo_only
                and out is not None
                and out.finish_reason is not None
                and out.finish_reason.type == "stop"
            ):
                async with contextlib.aclosing(answer_after_echo(state, job, i, out)) as more:
                    async for c in more:
                        acc[i] = accumulate(acc[i], c)

    try:
        await unless_disconnected(request, read(), on_gone=lambda: abort_all(state.engine, [s.rid for s in streams]))
    finally:
        await close_streams(state.engine, streams)
    return folded(acc)
