"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API), whole or streamed as Anthropic's events.

A request becomes a ChatCompletionRequest (messages_convert.py) and runs through the chat path (turns.py), so
templates, grammars and tool-call parsing are those of Chat Completions. Errors on these paths use Anthropic's
envelope (errors.error_response); usage splits the prompt into tokens read from the cache, tokens written to it
and the rest, as Anthropic counts them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from radixserve.server.errors import AnthropicError, AnthropicErrorBody, ApiError, anthropic_type
from radixserve.server.messages_convert import (
    NAMES,
    cache_ttl,
    chat_request,
    content_blocks,
    new_id,
    stop_reason,
)
from radixserve.server.messages_protocol import (
    BlockDelta,
    BlockStart,
    BlockStop,
    CacheCreation,
    CountTokensRequest,
    InputJsonDelta,
    MessageDelta,
    MessageEvent,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta as TextPiece,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolUseBlock,
)
from radixserve.server.handler import json_response, parse
from radixserve.server.serving import EventStream, ServerState, sse_json
from radixserve.server.tool_calls import ToolCall
from radixserve.server.turns import (
    CallDone,
    ReasoningDelta,
    TextDelta,
    TurnStream,
    cache_written,
    count_prompt,
    open_turn,
    run_turn,
)


def _usage(state: ServerState, ttl: str, prompt: int, cached: int, output: int) -> MessageUsage:
    written = cache_written(state, prompt, cached)
    by_ttl = CacheCreation(0 if ttl == "1h" else written, written if ttl == "1h" else 0)
    return MessageUsage(prompt - cached - written, output, written, cached, by_ttl)


async def create_message(request: Request) -> Response:
    state, req = await parse(request, MessagesRequest)
    chat, ttl = chat_request(req), cache_ttl(req)
    rid = new_id("msg")
    if req.stream:
        return EventStream(_events(state, rid, ttl, await open_turn(request, state, chat, rid, NAMES)))
    turn = await run_turn(request, state, chat, rid, NAMES)
    reason, sequence = stop_reason(turn)
    u = turn.usage
    use = _usage(state, ttl, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
    body = MessageResponse(rid, state.model_name, content_blocks(turn), reason, sequence, use)
    return json_response(state, body)


async def count_tokens(request: Request) -> Response:
    state, req = await parse(request, CountTokensRequest)
    n = await count_prompt(request, state, chat_request(req), NAMES)
    return json_response(state, TokenCount(n))


# ---------------------------------------------------------------- streaming


def _sse(state: ServerState, event: MessageEvent | AnthropicErrorBody) -> bytes:
    tag = "error" if isinstance(event, AnthropicErrorBody) else event.__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + sse_json(state.json, event) + b"\n\n"


class _Blocks:
    """Content blocks as Anthropic streams them: started, filled by deltas, stopped; numbered from 0."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.index = 0
        self.open: str | None = None  # "text" or "thinking" while a block takes deltas

    def delta(self, ev: TextDelta | ReasoningDelta) -> list[bytes]:
        kind = "thinking" if isinstance(ev, ReasoningDelta) else "text"
        out = self.close() if self.open not in (None, kind) else []
        if self.open is None:
            self.open = kind
            block = ThinkingBlock("") if kind == "thinking" else TextBlock("")
            out.append(_sse(self.state, BlockStart(self.index, block)))
        piece = ThinkingDelta(ev.text) if kind == "thinking" else TextPiece(ev.text)
        return out + [_sse(self.state, BlockDelta(self.index, piece))]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open, self.index = None, self.index + 1
        return [_sse(self.state, BlockStop(self.index - 1))]

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close() + [
            _sse(self.state, BlockStart(self.index, ToolUseBlock(call.id, call.name, {}))),
            _sse(self.state, BlockDelta(self.index, InputJsonDelta(call.arguments))),
            _sse(self.state, BlockStop(self.index)),
        ]
        self.index += 1
        return out


async def _events(state: ServerState, rid: str, ttl: str, opened: TurnStream) -> AsyncIterator[bytes]:
    """message_start, ping, then per block content_block_start / _delta / _stop (text_delta for text,
    thinking_delta for reasoning, input_json_delta for a tool's input), message_delta with the stop reason and usage, message_stop; an `error`
    event if the engine fails mid-stream (the status line is sent already)."""
    first = opened.streams[0].first.meta_info
    usage = _usage(state, ttl, first.prompt_tokens, first.cached_tokens, 0)
    blocks = _Blocks(state)
    try:
        yield _sse(state, MessageStart(MessageResponse(rid, state.model_name, [], None, None, usage)))
        yield _sse(state, Ping())
        async for ev in opened.events():
            for data in blocks.call(ev.call) if isinstance(ev, CallDone) else blocks.delta(ev):
                yield data
        for data in blocks.close():
            yield data
    except ApiError as err:
        yield _sse(state, AnthropicErrorBody(AnthropicError(anthropic_type(err.status), err.message)))
        return
    except Exception as exc:  # the engine died mid-stream: tell the client in-band
        yield _sse(state, AnthropicErrorBody(AnthropicError("api_error", f"engine failed: {exc}")))
        return
    finally:
        await opened.close()
    turn = opened.turn
    assert turn is not None
    reason, sequence = stop_reason(turn)
    u = turn.usage
    use = _usage(state, ttl, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
    yield _sse(state, MessageDelta(StopDelta(reason, sequence), use))
    yield _sse(state, MessageStop())
