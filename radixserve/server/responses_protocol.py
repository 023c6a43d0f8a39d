"""Bodies of OpenAI's Responses API (`/v1/responses`) as msgspec structs: the request, the response object with its
output items, and the typed stream events. Unknown request fields are errors, as in protocol.py; fields that never
change the tokens (metadata, user, include, truncation, ...) are declared and echoed or ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.server.protocol import Strict


# ---------------------------------------------------------------- request


class InputPart(Strict):
    """A content part: input_text / output_text carry text; other types (input_image, input_file) are refused."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(Strict):
    """One input item: a message (type "message" or omitted, with role and content), a function_call, a
    function_call_output, or a reasoning item (which clients echo back and is dropped)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class FunctionTool(Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Strict):
    type: str
    name: str | None = None


class TextFormat(Strict):
    type: str = "text"  # text, json_object, json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # prompt caching: echoed; the key groups agent retention's tool gaps, retention is the turn's (retention_hints.py)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # accepted and echoed or ignored: they never change the tokens
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # extras of open servers, as on Chat Completions
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = None
    priority: int = 0
    timeout: float | None = None


# ---------------------------------------------------------------- response


class OutputText(msgspec.Struct):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "output_text"


class MessageItem(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct):
    """A thinking model's reasoning (radixserve/server/reasoning.py), before its answer."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"
    type: str = "reasoning"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | NamedTool
    tools: list[FunctionTool]
    text: TextConfig
    store: bool
    reasoning: Reasoning | None
    prompt_cache_key: str | None
    prompt_cache_retention: str | None
    truncation: str
    user: str | None
    error: None = None
    object: str = "response"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response"


# ---------------------------------------------------------------- stream events (each SSE `event:` is its type)


class ResponseEvent(msgspec.Struct, tag_field="type"):
    sequence_number: int


class ResponseState(ResponseEvent):
    response: ResponseObject


class Created(ResponseState, tag="response.created"):
    pass


class InProgress(ResponseState, tag="response.in_progress"):
    pass


class Completed(ResponseState, tag="response.completed"):
    pass


class Incomplete(ResponseState, tag="response.incomplete"):
    pass


class ItemAdded(ResponseEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class ItemDone(ResponseEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class PartEvent(ResponseEvent):
    """An event about one content part of a message item."""

    item_id: str
    output_index: int
    content_index: int


class PartAdded(PartEvent, tag="response.content_part.added"):
    part: OutputText


class PartDone(PartEvent, tag="response.content_part.done"):
    part: OutputText


class TextDeltaEvent(PartEvent, tag="response.output_text.delta"):
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(PartEvent, tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningDeltaEvent(PartEvent, tag="response.reasoning_text.delta"):
    delta: str


class ReasoningDoneEvent(PartEvent, tag="response.reasoning_text.done"):
    text: str


class ArgsDelta(ResponseEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgsDone(ResponseEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent, tag="error"):
    message: str
    code: str | None
    param: str | None
