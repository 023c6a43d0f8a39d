"""What a chat turn's output becomes for the client: the assistant message (content or tool calls, parsed from the
model's own format), its logprobs, and the chat.completion.chunk stream, whose tool calls stop where the call list
closes (call_stop.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from radixserve.io import FinishReason, GenerateOutput, OutputMeta, StreamChunk
from radixserve.server.agent_retention import retain_turn
from radixserve.server.call_stop import CallWatch, answer_after_echo, end_at_calls
from radixserve.server.chat_job import thinking
from radixserve.server.handler import Job, accumulate, finish_reason, folded, observe_and_remember, usage
from radixserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaToolCall,
    ResponseFunction,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixserve.server.serving import ServerState, Stream, merged, sse
from radixserve.server.reasoning import ThinkSplit, pieces, split_reasoning
from radixserve.server.tool_calls import ToolFormat, StreamEvent, ToolCall
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


def response_message(
    text: str, parser: ToolFormat | None, truncated: bool = False, think: ThinkSplit | None = None
) -> tuple[ChatResponseMessage, bool]:
    """The assistant message for generated text, and whether it holds tool calls. `truncated` (ended by length): a
    call cut off part way is dropped, never returned as content (the complete calls before it are kept). `think`:
    the reasoning before the answer goes to reasoning_content."""
    reasoning, answer = ("", text) if think is None else split_reasoning(text, think)
    message = ChatResponseMessage("assistant", answer, reasoning_content=reasoning or None)
    if parser is None:
        return message, False
    # the parser's content: the text itself, unless calls (or echoes of answered ones, or a cut-off call) came out
    message.content, calls = parser.parse(answer, truncated)
    if calls:
        message.tool_calls = [_response_call(c) for c in calls]
    return message, bool(calls)


def chat_choice(
    state: ServerState, job: Job, parser: ToolFormat | None, i: int, out: GenerateOutput, logprobs: bool
) -> ChatChoice:
    """Choice i of a whole answer; a turn that ended in tool calls keeps its prefix for the tool gap
    (agent_retention.py)."""
    truncated = out.finish_reason is not None and out.finish_reason.type == "length"
    message, called = response_message(out.text, parser, truncated, thinking(state, job))
    retain_turn(state, job, out, [c.id for c in message.tool_calls or []])
    return ChatChoice(
        i,
        message,
        chat_reason(out.finish_reason, called),
        chat_logprobs(state.engine.tokenizer, out.meta_info) if logprobs else None,
    )


def _response_call(c: ToolCall) -> ResponseToolCall:
    return ResponseToolCall(c.id, ResponseFunction(c.name, c.arguments))


def chat_reason(fin: FinishReason | None, called: bool) -> str | None:
    reason = finish_reason(fin)
    return "tool_calls" if called and reason == "stop" else reason


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
    parser: ToolFormat | None,
) -> AsyncIterator[bytes]:
    """chat.completion.chunk events (handler.guarded_events adds [DONE] and errors): a role delta per choice,
    reasoning, content and tool-call deltas, a finish chunk. A choice whose call list closes ends there with
    `tool_calls` (its engine request aborted)."""
    tok = state.engine.tokenizer
    acc: list[GenerateOutput | None] = [None] * len(streams)
    thinks = [thinking(state, job) for _ in streams]
    watches = [CallWatch(parser) if parser is not None else None for _ in streams]

    def chunk(choices: list[ChatChunkChoice], use: Usage | None = None) -> bytes:
        return sse(state, ChatCompletionChunk(job.rid, created, state.model_name, choices, use))

    for i in range(len(streams)):
        yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])

    def take(i: int, c: StreamChunk) -> tuple[str | None, list[ChatChunkChoice]]:
        """Fold chunk c into choice i's output: its finish reason, and its deltas."""
        acc[i] = accumulate(acc[i], c)
        meta = c.meta_info
        reason = finish_reason(meta.finish_reason)
        lp = chat_logprobs(tok, meta) if logprobs and meta.output_token_logprobs else None
        return reason, _deltas(i, thinks[i], watches[i], c.text, reason, lp)

    async with contextlib.aclosing(merged(streams)) as events:
        async for i, c in events:
            watch = watches[i]
            if watch is not None and watch.closed:
                continue  # ended at its calls already: what follows is the abort's chunk
            reason, deltas = take(i, c)
            for choice in deltas:
                yield chunk([choice])
            if watch is not None and watch.closed and reason is None:
                acc[i], reason = end_at_calls(state, streams[i], acc[i]), "stop"  # type: ignore[arg-type]
            if reason == "stop" and watch is not None and watch.echo_only and thinks[i] is None:
                # only echoes of answered calls: asked again for an answer, streamed as the rest of this one
                async with contextlib.aclosing(answer_after_echo(state, job, i, acc[i])) as more:  # type: ignore[arg-type]
                    async for c in more:
                        reason, deltas = take(i, c)
                        for choice in deltas:
                            yield chunk([choice])
            if reason is not None:
                calls = watch.split.calls.calls if watch is not None else []
                retain_turn(state, job, acc[i], [c.id for c in calls])  # type: ignore[arg-type]
                called = watch is not None and watch.split.count > 0
                yield chunk([ChatChunkChoice(i, ChatDelta(), "tool_calls" if called and reason == "stop" else reason)])
    if include_usage:
        yield chunk([], usage(folded(acc), job.n))
    observe_and_remember(state, job, folded(acc), chat=True)


def _deltas(
    i: int, think: ThinkSplit | None, watch: CallWatch | None, text: str, reason: str | None, lp: ChatLogprobs | None
) -> list[ChatChunkChoice]:
    """Choice i's deltas for a piece of its text (and what was held back, once it has ended): reasoning, content,
    tool calls; the piece's logprobs go with the first of them."""
    out = []
    for kind, piece in pieces(think, text, reason is not None):
        if kind == "reasoning":
            out.append(ChatChunkChoice(i, ChatDelta(reasoning_content=piece)))
        elif watch is None:
            out.append(ChatChunkChoice(i, ChatDelta(content=piece)))
        else:
            out.extend(_event_deltas(i, watch.feed(piece)))
    if watch is not None and reason is not None:
        out.extend(_event_deltas(i, watch.finish(reason == "length")))
    if lp is not None:
        if not out:
            out.append(ChatChunkChoice(i, ChatDelta(content="")))
        out[0].logprobs = lp
    return out


def _event_deltas(i: int, events: list[StreamEvent]) -> list[ChatChunkChoice]:
    out = []
    for ev in events:
        if ev.call is not None:
            out.extend(_call_deltas(i, ev.call, ev.index))
        elif ev.content:
            out.append(ChatChunkChoice(i, ChatDelta(content=ev.content)))
    return out
