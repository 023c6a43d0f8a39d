"""`/v1/chat/completions`: one request top to bottom, in handler.py's stages. The job is built and run by chat_job.py
(template, grammars for `response_format` and `tools`, tool calls ended where their list closes), and the answer is
shaped by chat_output.py (the message, or the chat.completion.chunk stream, with tool calls parsed from the model's
own format)."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from radixserve.server.chat_job import prepare_chat, run_chat
from radixserve.server.chat_output import chat_choice, chat_events
from radixserve.server.handler import event_stream, json_response, observe_and_remember, parse, start_streams, usage
from radixserve.server.protocol import ChatCompletionRequest, ChatCompletionResponse


async def chat_completions(request: Request) -> Response:
    state, req = await parse(request, ChatCompletionRequest)
    job, shape = await prepare_chat(request, state, req, f"chatcmpl-{uuid.uuid4().hex}")
    created = int(time.time())
    if req.stream:
        streams = await start_streams(request, state, job, "messages")
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = chat_events(state, job, streams, created, req.logprobs, include_usage, shape.parser)
        return event_stream(state, job, streams, events)

    outs = await run_chat(request, state, job, shape)
    choices = [chat_choice(state, job, shape.parser, i, o, req.logprobs) for i, o in enumerate(outs)]
    observe_and_remember(state, job, outs, chat=True)
    body = ChatCompletionResponse(job.rid, created, state.model_name, choices, usage(outs, job.n))
    return json_response(state, body)
