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
    chat_request,
    content_blocks,
    new_id,
    stop_reason,
)
from radixserve.server.messages_protocol import (
    BlockDelta,
    BlockStart,
    BlockStop,
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
    TextDelta,
    TokenCount,
    ToolUseBlock,
)
from radixserve.server.serving import EventStream, ServerState, read_json, server_state
from radixserve.server.turns import CallDone, TurnStream, cache_written, count_prompt, open_turn, run_turn


def _usage(state: ServerState, prompt: int, cached: int, output: int) -> MessageUsage:
    written = cache_written(state, prompt, cached)
    return MessageUsage(prompt - cached - written, output, written, cached)


async def create_message(request: Request) -> Response:
    state = server_state(request)
    req = await read_json(request, MessagesRequest)
    chat = chat_request(req)
    rid = new_id("msg")
    if req.stream:
        return EventStream(_events(state, rid, await open_turn(request, state, chat, rid, NAMES)))
    turn = await run_turn(request, state, chat, rid, NAMES)
    reason, sequence = stop_reason(turn)
    u = turn.usage
    use = _usage(state, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
    body = MessageResponse(rid, state.model_name, content_blocks(turn), reason, sequence, use)
    return Response(state.json.encode(body), media_type="application/json")


async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    req = await read_json(request, CountTokensRequest)
    n = await count_prompt(request, state, chat_request(req), NAMES)
    return Response(state.json.encode(TokenCount(n)), media_type="application/json")


# ---------------------------------------------------------------- streaming


def _sse(state: ServerState, event: MessageEvent | AnthropicErrorBody) -> bytes:
    tag = "error" if isinstance(event, AnthropicErrorBody) else event.__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + state.json.encode(event) + b"\n\n"


async def _events(state: ServerState, rid: str, opened: TurnStream) -> AsyncIterator[bytes]:
    """message_start, ping, then per block content_block_start / _delta / _stop (text_delta for text,
    input_json_delta for a tool's input), message_delta with the stop reason and usage, message_stop; an `error`
    event if the engine fails mid-stream (the status line is sent already)."""
    first = opened.streams[0].first.meta_info
    usage = _usage(state, first.prompt_tokens, first.cached_tokens, 0)
    index, text_open = 0, False
    try:
        yield _sse(state, MessageStart(MessageResponse(rid, state.model_name, [], None, None, usage)))
        yield _sse(state, Ping())
        async for ev in opened.events():
            if isinstance(ev, CallDone):
                if text_open:
                    yield _sse(state, BlockStop(index))
                    index, text_open = index + 1, False
                call = ev.call
                yield _sse(state, BlockStart(index, ToolUseBlock(call.id, call.name, {})))
                yield _sse(state, BlockDelta(index, InputJsonDelta(call.arguments)))
                yield _sse(state, BlockStop(index))
                index += 1
                continue
            if not text_open:
                yield _sse(state, BlockStart(index, TextBlock("")))
                text_open = True
            yield _sse(state, BlockDelta(index, TextDelta(ev.text)))
        if text_open:
            yield _sse(state, BlockStop(index))
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
    use = _usage(state, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
    yield _sse(state, MessageDelta(StopDelta(reason, sequence), use))
    yield _sse(state, MessageStop())
