"""`GET /openapi.json`: an OpenAPI 3.1 description generated from the msgspec types the server decodes requests
with, so that it cannot drift from what the server accepts (schemathesis fuzzes the server from it in the tests).

Every route of the app is here (tests/test_openapi.py checks it against the app's routing table). What the types
cannot say is added to their schemas: exactly one of a prompt's forms, and token ids bounded by the vocabulary of
the model served (the description is built per app)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.server.cache_view import MAX_DEPTH, MAX_NODES
from radixserve.server.dashboard import WhyMissRequest
from radixserve.server.errors import AnthropicErrorBody, ErrorBody
from radixserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from radixserve.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateBody,
    PinRequest,
    TokenizeRequest,
)
from radixserve.server.responses_protocol import ResponsesRequest

JSON, SSE, TEXT, HTML = "application/json", "text/event-stream", "text/plain", "text/html"
ERROR_STATUSES = ("400", "401", "403", "404", "408", "409", "413", "429", "500", "503", "504")


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    body: type | None = None
    media: tuple[str, ...] = (JSON,)  # of the 200 answer
    query: tuple[dict[str, Any], ...] = ()
    admin: str | None = None  # what only an admin key (or no keys configured) may do here
    error: type = ErrorBody  # the error envelope: OpenAI's, or Anthropic's under /v1/messages
    path_params: tuple[str, ...] = ()


NAMESPACE = _query("namespace", {"type": "string"}, "a namespace to show (a user key: only its own)")
FLUSH_KEY = _query("key", {"type": "string"}, "flush only this key's namespaces (another key's: admin only)")
OPERATIONS = (
    Operation("post", "/v1/chat/completions", "Create a chat completion (OpenAI-compatible)", ChatCompletionRequest),
    Operation("post", "/v1/completions", "Create a completion (OpenAI-compatible)", CompletionRequest, (JSON, SSE)),
    Operation("post", "/v1/responses", "Create a response (OpenAI Responses API)", ResponsesRequest, (JSON, SSE)),
    Operation(
        "get", "/v1/responses/{response_id}", "A stored response (OpenAI Responses API)", path_params=("response_id",)
    ),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response", path_params=("response_id",)),
    Operation(
        "post",
        "/v1/messages",
        "Create a message (Anthropic Messages API)",
        MessagesRequest,
        (JSON, SSE),
        error=AnthropicErrorBody,
    ),
    Operation(
        "post",
        "/v1/messages/count_tokens",
        "Count a message's prompt tokens (Anthropic Messages API)",
        CountTokensRequest,
        error=AnthropicErrorBody,
    ),
    Operation("get", "/v1/models", "The served model"),
    Operation("post", "/generate", "Generate (SGLang-native)", GenerateBody, (JSON, SSE)),
    Operation("post", "/tokenize", "Token ids of a prompt", TokenizeRequest),
    Operation("post", "/detokenize", "Text of token ids", DetokenizeRequest),
    Operation("post", "/flush_cache", "Drop cached pages", query=(FLUSH_KEY,), admin="flush every namespace"),
    Operation("get", "/flush_cache", "Drop cached pages", query=(FLUSH_KEY,), admin="flush every namespace"),
    Operation("post", "/cache/pin", "Keep a prompt's cached prefix out of eviction", PinRequest),
    Operation("post", "/cache/unpin", "Release a pin", PinRequest),
    Operation("post", "/cache/why_miss", "Why a prompt misses the cache, page by page", WhyMissRequest),
    Operation(
        "get",
        "/cache/tree",
        "The radix tree, as the key may see it",
        query=(
            _query("depth", {"type": "integer", "minimum": 0, "maximum": MAX_DEPTH}, "levels below the path"),
            _query("max_nodes", {"type": "integer", "minimum": 1, "maximum": MAX_NODES}, "nodes at most"),
            NAMESPACE,
            _query("path", {"type": "string", "pattern": "^([0-9a-f]{1,16}(,[0-9a-f]{1,16})*)?$"}, "node keys"),
        ),
        admin="every namespace",
    ),
    Operation("get", "/cache/stats", "Cache figures, as the key may see them", admin="every namespace"),
    Operation(
        "get",
        "/cache/events",
        "Cache figures as server-sent events, one per interval, until the client leaves",
        media=(SSE,),
        query=(_query("interval_ms", {"type": "integer", "minimum": 100, "maximum": 60000}, "between events"),),
        admin="every namespace",
    ),
    Operation("get", "/dashboard", "The cache explorer's page", media=(HTML,)),
    Operation("get", "/get_model_info", "Model and engine settings", admin="the model's path"),
    Operation("get", "/server_info", "Server settings (SGLang-native)"),
    Operation("get", "/get_server_info", "Server settings (SGLang-native; as /server_info)"),
    Operation(
        "post", "/abort_request", "Abort running /generate requests by rid (SGLang-native; no body)", AbortRequest, ()
    ),
    Operation("get", "/health", "200 while the engine serves (no body)", media=()),
    Operation("get", "/metrics", "Prometheus metrics", media=(TEXT,), admin="server-wide figures, every key's"),
    Operation("get", "/openapi.json", "This description"),
)
# Bodies that take exactly one of these fields (each may be sent as null, meaning absent).
ONE_OF = {
    GenerateBody: ("text", "input_ids"),
    PinRequest: ("text", "input_ids"),
    WhyMissRequest: ("text", "input_ids", "messages"),
}
TOKEN_ID_LISTS = ((DetokenizeRequest, "tokens"), (PinRequest, "input_ids"), (WhyMissRequest, "input_ids"))


def openapi_document(title: str, version: str, vocab_size: int) -> dict[str, Any]:
    bodies = list(dict.fromkeys(op.body for op in OPERATIONS if op.body is not None))
    types = [*bodies, ErrorBody, AnthropicErrorBody]
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    refs = dict(zip(types, schemas))
    _constrain(components, vocab_size)
    paths: dict[str, Any] = {}
    for op in OPERATIONS:
        errors = {s: {"description": "an error", "content": {JSON: {"schema": refs[op.error]}}} for s in ERROR_STATUSES}
        op_id = op.path.strip("/").replace("/", "_").replace(".", "_").replace("{", "").replace("}", "")
        spec: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{op.method}_{op_id}",
            "responses": {"200": _answer(op), **errors},
        }
        if op.body is not None:
            spec["requestBody"] = {"required": True, "content": {JSON: {"schema": refs[op.body]}}}
        params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in op.path_params]
        if op.query or params:
            spec["parameters"] = [*params, *op.query]
        if op.admin is not None:
            spec["description"] = f"Admin only: {op.admin}. A user key sees or changes its own namespaces."
            spec["x-admin-only"] = op.admin
        paths.setdefault(op.path, {})[op.method] = spec
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }


def _answer(op: Operation) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": op.summary}
    if op.media:
        answer["content"] = {m: {} for m in op.media}
    return answer


def _constrain(components: dict[str, Any], vocab_size: int) -> None:
    """What the server checks beyond the types: one prompt form exactly, token ids inside the vocabulary."""
    for type_, fields in ONE_OF.items():
        components[type_.__name__]["oneOf"] = [
            {"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in fields
        ]
    ids = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for type_, field in TOKEN_ID_LISTS:
        prop = components[type_.__name__]["properties"][field]
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == "array":
                branch["items"] = ids
        prop["description"] = f"token ids, each in [0, {vocab_size})"
    for type_, field in ((GenerateBody, "input_ids"), (CompletionRequest, "prompt")):
        components[type_.__name__]["properties"][field]["description"] = (
            f"token ids (a list, or a list of lists for a batch), each in [0, {vocab_size})"
            + ("; or text" if field == "prompt" else "")
        )
