"""Bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as msgspec structs: requests,
the message response with its content blocks, and the stream events. Unknown request fields are errors, as in
protocol.py; `cache_control` is accepted on every block and tool, and its ttl retains the request's prefix."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.server.protocol import CacheControl, Strict


# ---------------------------------------------------------------- requests


class Block(Strict):
    """A content block: text, tool_use (assistant), tool_result (user), thinking / redacted_thinking (echoed back
    and dropped); image and document blocks are refused."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: dict[str, Any] | None = None
    citations: list[Any] | None = None
    cache_control: CacheControl | None = None
    # what the SDK echoes back of a tool_use block it received: who called the tool, and the tool's toolset
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class InputMessage(Strict):
    role: str
    content: str | list[Block]


class ToolSpec(Strict):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or omitted; Anthropic's server tools are refused
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoice(Strict):
    type: str  # auto, any, tool, none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: str  # enabled, disabled
    budget_tokens: int | None = None


class PromptFields(Strict):
    """What makes the prompt: the fields /v1/messages/count_tokens takes."""

    model: str
    messages: list[InputMessage]
    system: str | list[Block] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(PromptFields, kw_only=True):
    pass


class OutputFormat(Strict):
    type: str  # json_schema
    schema: dict[str, Any] | None = None


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted: the model's effort is not a setting here


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    cache_control: CacheControl | None = None  # automatic caching: the prefix is retained under its ttl
    # accepted and ignored: they never change the tokens
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    # extras of open servers, as on Chat Completions
    seed: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    timeout: float | None = None


# ---------------------------------------------------------------- responses


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    """A thinking model's reasoning (radixserve/server/reasoning.py); no signature: nothing here verifies one."""

    thinking: str
    signature: str = ""


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class CacheCreation(msgspec.Struct):
    """The tokens written to the cache, under the `cache_control` ttl the request asked for."""

    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(msgspec.Struct):
    """input_tokens counts the prompt tokens neither read from nor written to the cache, as Anthropic counts them."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation


class MessageResponse(msgspec.Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---------------------------------------------------------------- stream events (each SSE `event:` is its type)


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageEvent(msgspec.Struct, tag_field="type"):
    pass


class MessageStart(MessageEvent, tag="message_start"):
    message: MessageResponse


class BlockStart(MessageEvent, tag="content_block_start"):
    index: int
    content_block: ContentBlock


class BlockDelta(MessageEvent, tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class BlockStop(MessageEvent, tag="content_block_stop"):
    index: int


class Ping(MessageEvent, tag="ping"):
    pass


class MessageDelta(MessageEvent, tag="message_delta"):
    delta: StopDelta
    usage: MessageUsage  # cumulative, with the cache counts, as Anthropic sends it


class MessageStop(MessageEvent, tag="message_stop"):
    pass
