"""`/v1/responses` (OpenAI's Responses API): create (whole or streamed as typed events), retrieve and delete.

A request becomes a ChatCompletionRequest (responses_convert.py) and runs through the chat path (turns.py), so
templates, grammars and tool-call parsing are those of Chat Completions. Stored responses (response_store.py) let
a client send only its new turn with `previous_response_id`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixserve.server.errors import ApiError, bad_request
from radixserve.server.protocol import ChatMessage
from radixserve.server.response_store import ResponseStore
from radixserve.server.responses_convert import (
    NAMES,
    assistant_message,
    chat_request,
    input_messages,
    new_id,
    turn_items,
)
from radixserve.server.responses_protocol import (
    Completed,
    Created,
    Incomplete,
    DeletedResponse,
    ErrorEvent,
    IncompleteDetails,
    InProgress,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from radixserve.server.handler import json_response, parse
from radixserve.server.serving import EventStream, ServerState, cache_salt, server_state
from radixserve.server.responses_stream import Emitter
from radixserve.server.turns import CallDone, Turn, TurnStream, open_turn, run_turn


def response_store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no stored response with id {response_id!r}",
        param=param,
        code="response_not_found",
        type="not_found_error",
    )


def _history(request: Request, req: ResponsesRequest) -> list[ChatMessage]:
    if req.previous_response_id is None:
        return []
    stored = response_store(request).get(cache_salt(request, None), req.previous_response_id)
    if stored is None:
        raise _not_found(req.previous_response_id, "previous_response_id")
    return stored.conversation


def _usage(turn: Turn) -> ResponseUsage:
    u = turn.usage
    details = InputTokensDetails(u.prompt_tokens_details.cached_tokens)
    return ResponseUsage(u.prompt_tokens, details, u.completion_tokens, OutputTokensDetails(), u.total_tokens)


def _response(
    state: ServerState, req: ResponsesRequest, rid: str, created: int, output: list[OutputItem], turn: Turn | None
) -> ResponseObject:
    """The response object: in progress while `turn` is None, then completed (incomplete when out of tokens)."""
    status, incomplete = "in_progress", None
    if turn is not None:
        status = "incomplete" if turn.reason == "length" else "completed"
        incomplete = IncompleteDetails("max_output_tokens") if turn.reason == "length" else None
    return ResponseObject(
        id=rid,
        created_at=created,
        model=state.model_name,
        status=status,
        output=output,
        usage=_usage(turn) if turn is not None else None,
        incomplete_details=incomplete,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        temperature=req.temperature,
        top_p=req.top_p,
        tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        tools=req.tools or [],
        text=req.text or TextConfig(),
        store=req.store,
        reasoning=req.reasoning,
        prompt_cache_key=req.prompt_cache_key,
        prompt_cache_retention=req.prompt_cache_retention,
        truncation=req.truncation or "disabled",
        user=req.user,
    )


def _keep(request: Request, req: ResponsesRequest, body: ResponseObject, conversation: list[ChatMessage]) -> None:
    if req.store:
        turn = [*conversation, assistant_message(body.output)]
        response_store(request).put(cache_salt(request, None), body, turn)


async def create_response(request: Request) -> Response:
    state, req = await parse(request, ResponsesRequest)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    conversation = [*_history(request, req), *input_messages(req.input)]
    chat = chat_request(req, conversation)
    rid, created = new_id("resp"), int(time.time())
    if req.stream:
        opened = await open_turn(request, state, msgspec.structs.replace(chat, stream=True), rid, NAMES)
        return EventStream(_events(request, state, req, rid, created, opened, conversation))
    turn = await run_turn(request, state, chat, rid, NAMES)
    body = _response(state, req, rid, created, turn_items(turn), turn)
    _keep(request, req, body, conversation)
    return json_response(state, body)


async def get_response(request: Request) -> Response:
    state = server_state(request)
    response_id = request.path_params["response_id"]
    stored = response_store(request).get(cache_salt(request, None), response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(state, stored.response)


async def delete_response(request: Request) -> Response:
    state = server_state(request)
    response_id = request.path_params["response_id"]
    if not response_store(request).delete(cache_salt(request, None), response_id):
        raise _not_found(response_id)
    return json_response(state, DeletedResponse(response_id))


# ---------------------------------------------------------------- streaming


async def _events(
    request: Request,
    state: ServerState,
    req: ResponsesRequest,
    rid: str,
    created: int,
    opened: TurnStream,
    conversation: list[ChatMessage],
) -> AsyncIterator[bytes]:
    """created, in_progress, the output items' events, then completed (incomplete when out of tokens, as OpenAI
    sends it); an `error` event if the
    engine fails mid-stream (the status line is sent already)."""
    out = Emitter(state)
    try:
        yield out.sse(Created, response=_response(state, req, rid, created, [], None))
        yield out.sse(InProgress, response=_response(state, req, rid, created, [], None))
        async for ev in opened.events():
            for data in out.call(ev.call) if isinstance(ev, CallDone) else out.delta(ev):
                yield data
        for data in out.close():
            yield data
    except ApiError as err:
        yield out.sse(ErrorEvent, message=err.message, code=err.code or err.type, param=err.param)
        return
    except Exception as exc:  # the engine died mid-stream: tell the client in-band
        yield out.sse(ErrorEvent, message=f"engine failed: {exc}", code="service_unavailable", param=None)
        return
    finally:
        await opened.close()
    assert opened.turn is not None
    body = _response(state, req, rid, created, out.output, opened.turn)
    _keep(request, req, body, conversation)
    yield out.sse(Incomplete if body.status == "incomplete" else Completed, response=body)
