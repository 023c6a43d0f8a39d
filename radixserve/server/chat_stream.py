"""/v1/chat/completions streamed: chat.completion.chunk events as OpenAI streams them (a role delta per choice,
content and tool-call deltas, a finish chunk, usage, [DONE]), and the per-token logprobs both shapes carry."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from radixserve.io import GenerateOutput, OutputMeta
from radixserve.server.agent_retention import retain_turn
from radixserve.server.errors import ApiError
from radixserve.server.openai_api import (
    Job,
    accumulate,
    error_event,
    finish_reason,
    folded,
    observe_and_remember,
    usage,
)
from radixserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    DeltaToolCall,
    ResponseFunction,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixserve.server.serving import SSE_DONE, ServerState, Stream, close_streams, in_band, merged, sse
from radixserve.server.tool_calls import HermesToolFormat, ToolCall, ToolStream
from radixserve.tokenizer import Tokenizer


def chat_logprobs(tok: Tokenizer, meta: OutputMeta) -> ChatLogprobs:
    lps = meta.output_token_logprobs or []
    tops = meta.output_top_logprobs or [[] for _ in lps]
    content = []
    for (lp, tid), top in zip(lps, tops):
        # The token's own bytes: a piece of a multi-byte character has no text of its own (OpenAI's `bytes` field).
        alts = [TopLogprob(tok.token_to_str(t), v, list(tok.token_bytes(t))) for v, t in top or []]
        content.append(TokenLogprob(tok.token_to_str(tid), lp, list(tok.token_bytes(tid)), alts))
    return ChatLogprobs(content)


def _call_deltas(i: int, call: ToolCall, index: int) -> list[ChatChunkChoice]:
    """A tool call as OpenAI streams it: its id, type and name with empty arguments, then the arguments."""
    head = DeltaToolCall(index, ResponseFunction(call.name, ""), call.id, "function")
    return [
        ChatChunkChoice(i, ChatDelta(tool_calls=[head])),
        ChatChunkChoice(i, ChatDelta(tool_calls=[DeltaToolCall(index, ResponseFunction(arguments=call.arguments))])),
    ]


async def chat_events(
    state: ServerState,
    job: Job,
    streams: list[Stream],
    created: int,
    logprobs: bool,
    include_usage: bool,
    parser: HermesToolFormat | None,
) -> AsyncIterator[bytes]:
    """SSE of chat.completion.chunk objects: a role delta per choice, content and tool-call deltas, a finish chunk,
    [DONE]."""
    tok = state.engine.tokenizer
    acc: list[GenerateOutput | None] = [None] * len(streams)
    splits = [ToolStream(parser) if parser is not None else None for _ in streams]
    call_ids: list[list[str]] = [[] for _ in streams]

    def chunk(choices: list[ChatChunkChoice], use: Usage | None = None) -> bytes:
        return sse(state, ChatCompletionChunk(job.rid, created, state.model_name, choices, use))

    try:
        for i in range(len(streams)):
            yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
        async with contextlib.aclosing(merged(streams)) as events:
            async for i, c in events:
                acc[i] = accumulate(acc[i], c)
                meta = c.meta_info
                reason = finish_reason(meta.finish_reason)
                lp = chat_logprobs(tok, meta) if logprobs and meta.output_token_logprobs else None
                split = splits[i]
                if split is None:
                    if c.text or lp is not None:
                        yield chunk([ChatChunkChoice(i, ChatDelta(content=c.text), None, lp)])
                else:
                    pieces = split.feed(c.text) + (split.finish(reason == "length") if reason is not None else [])
                    for ev in pieces:
                        if ev.call is not None:
                            call_ids[i].append(ev.call.id)
                            for choice in _call_deltas(i, ev.call, ev.index):
                                yield chunk([choice])
                        elif ev.content:
                            yield chunk([ChatChunkChoice(i, ChatDelta(content=ev.content))])
                if reason is not None:
                    retain_turn(state, job, acc[i], call_ids[i])  # type: ignore[arg-type]
                    called = split is not None and split.count > 0
                    yield chunk(
                        [ChatChunkChoice(i, ChatDelta(), "tool_calls" if called and reason == "stop" else reason)]
                    )
        if include_usage:
            yield chunk([], usage(folded(acc), job.n))
        observe_and_remember(state, job, folded(acc), chat=True)
    except ApiError as err:
        yield error_event(state, err)
    except Exception as exc:  # mid-stream: tell the client in-band, the status line is gone
        yield error_event(state, in_band(exc, job.renames))
    finally:
        await close_streams(state.engine, streams)
    yield SSE_DONE
