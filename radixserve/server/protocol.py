"""Request and response bodies of the HTTP API as msgspec structs.

Requests forbid unknown fields: a field we do not know may change what the client expects (a new sampling option,
...), so it gets a 400 naming it rather than being silently ignored. Fields that never change the output
(user, metadata, store, ...) are declared and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from radixserve.server import sglang_fields
from radixserve.server.errors import bad_request, from_decode_error


# Free text the server echoes back or shows (a rid in meta_info.id, a tool's name in tool calls, a cache_salt in
# the cache views and metrics) is bounded: no answer, log line or metrics label grows with what a client sends.
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]  # visible ASCII
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names
Salt = Annotated[str, msgspec.Meta(max_length=256)]
# A prompt the server would refuse as empty is refused by the schema (and so described in /openapi.json).
Text = Annotated[str, msgspec.Meta(min_length=1)]
NonEmptyList = Annotated[list[Any], msgspec.Meta(min_length=1)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of request bodies: unknown fields are errors; keyword-only so subclasses may add required fields."""


# ---------------------------------------------------------------- requests


class CacheControl(Strict):
    """Anthropic's prompt-caching marker, on /v1/messages blocks and on Chat Completions content parts (as OpenRouter
    and LiteLLM pass it through): the request's prefix is retained for its ttl (retention_hints.py)."""

    type: str = "ephemeral"
    ttl: str | None = None  # "5m" or "1h"


class ContentPart(Strict):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text
    parsed_arguments: Any = None  # accepted (the SDK's `parse` adds it, and its docs send the message back) and ignored


class MessageToolCall(Strict):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None  # accepted (the SDK echoes it back) and ignored
    parsed: Any = None  # the same for `parse`'s parsed answer
    reasoning_content: str | None = None  # the same for our answers' own field (a thinking model's reasoning)


class FunctionDef(Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: str
    function: FunctionDef


class NamedFunction(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: str
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: str  # text, json_object, json_schema
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The sampling fields shared by chat and completions (OpenAI names plus the usual extras of open servers)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias and SGLang's extras, under their SamplingParams names but min_tokens (min_new_tokens)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Salt | None = None
    priority: int = 0  # extra: higher is admitted first and may retract lower-priority requests
    timeout: float | None = None  # extra: seconds after which the request is aborted and its pages freed
    pin: bool = False  # keep the prompt's cached prefix out of eviction (see /cache/pin)
    # retention (radixserve/server/retention_hints.py): keep the finished prefix (prompt + answer) ahead of LRU
    retention_seconds: float | None = None  # extra: for this long after its last hit
    retention_priority: int = 50  # extra: 1..100, higher is evicted later
    prompt_cache_retention: str | None = None  # OpenAI's: "in_memory" (10 minutes here) or "24h"
    prompt_cache_key: str | None = None  # OpenAI's bucket: agent retention learns tool gaps per tenant and key
    # accepted and ignored: they never change the tokens
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables, e.g. enable_thinking (vLLM's)


class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec allows one array type in a union, so lists are checked by hand
    prompt: Text | NonEmptyList
    echo: bool = False
    logprobs: int | None = None


class GenerateFields(Strict):
    """SGLang-native /generate: exactly one of text / input_ids, single or batch. The fields radixserve implements;
    GenerateBody adds the rest of SGLang's GenerateReqInput (radixserve/server/sglang_fields.py)."""

    text: Text | Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    input_ids: NonEmptyList | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[Any] | None = None  # ids (or a list of them per prompt) whose logprobs each position has
    return_text_in_logprobs: bool = False
    cache_salt: Salt | None = None
    extra_key: Salt | None = None  # SGLang's extra cache key: one more part of the cache namespace
    rid: Label | list[Label] | None = None  # a label echoed in meta_info.id; the server's own id is unique per request
    priority: int = 0
    timeout: float | None = None
    pin: bool = False  # keep the prompt's cached prefix out of eviction once done (see /cache/pin)
    retention_seconds: float | None = None  # keep the finished prefix (prompt + output) ahead of LRU this long
    retention_priority: int = 50  # 1..100, higher is evicted later (radixserve/cache/retention.py)


GenerateBody = msgspec.defstruct(
    "GenerateBody", [(name, Any, None) for name in sglang_fields.DECLARED], bases=(GenerateFields,), kw_only=True
)


class AbortRequest(Strict):
    """/abort_request (SGLang's AbortReq, as its clients send it)."""

    rid: str = ""
    abort_all: bool = False


class PinRequest(Strict):
    """/cache/pin and /cache/unpin: one prompt, as text or token ids, in a cache namespace."""

    text: str | None = None
    input_ids: list[int] | None = None
    cache_salt: Salt | None = None


class TokenizeRequest(Strict):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(Strict):
    tokens: list[int]
    skip_special_tokens: bool = False
    model: str | None = None


def decode_body(body: bytes, type_: type) -> Any:
    """Decode a JSON body into `type_`, or raise ApiError 400 naming the bad field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.MsgspecError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"malformed JSON body: not UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_json"
        ) from None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ResponseFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunction
    type: str = "function"


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None  # a thinking model's reasoning (vLLM's and DeepSeek's field)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    function: ResponseFunction
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "radixserve"
    max_model_len: int | None = None
    sampling_defaults: dict[str, Any] | None = None  # what requests that leave them unset get
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
