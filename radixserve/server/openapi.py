"""`GET /openapi.json`: an OpenAPI 3.1 description generated from the msgspec types the server decodes requests
with, so that it cannot drift from what the server accepts (schemathesis fuzzes the server from it in the tests)."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.server.errors import ErrorBody
from radixserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from radixserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateBody,
    PinRequest,
    TokenizeRequest,
)
from radixserve.server.responses_protocol import ResponsesRequest

POST_ROUTES: dict[str, tuple[type, str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "Create a chat completion (OpenAI-compatible)"),
    "/v1/completions": (CompletionRequest, "Create a completion (OpenAI-compatible)"),
    "/v1/responses": (ResponsesRequest, "Create a response (OpenAI Responses API)"),
    "/v1/messages": (MessagesRequest, "Create a message (Anthropic Messages API; errors in Anthropic's envelope)"),
    "/v1/messages/count_tokens": (CountTokensRequest, "Count a message's prompt tokens (Anthropic Messages API)"),
    "/generate": (GenerateBody, "Generate (SGLang-native)"),
    "/tokenize": (TokenizeRequest, "Token ids of a prompt"),
    "/detokenize": (DetokenizeRequest, "Text of token ids"),
    "/cache/pin": (PinRequest, "Keep a prompt's cached prefix out of eviction"),
    "/cache/unpin": (PinRequest, "Release a pin"),
}
GET_ROUTES = {
    "/v1/models": "The served model",
    "/get_model_info": "Model and engine settings",
    "/health": "200 while the engine serves",
}
ERROR_STATUSES = ("400", "404", "408", "413", "429", "500", "503")


def openapi_document(title: str, version: str) -> dict[str, Any]:
    types = [t for t, _ in POST_ROUTES.values()] + [ErrorBody]
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    refs = dict(zip(types, schemas))
    errors = {
        s: {"description": "an error", "content": {"application/json": {"schema": refs[ErrorBody]}}}
        for s in ERROR_STATUSES
    }
    paths: dict[str, Any] = {}
    for path, (type_, summary) in POST_ROUTES.items():
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {"required": True, "content": {"application/json": {"schema": refs[type_]}}},
                "responses": {
                    "200": {"description": "the result (a JSON body, or server-sent events with stream)"},
                    **errors,
                },
            }
        }
    for path, summary in GET_ROUTES.items():
        paths[path] = {
            "get": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_"),
                "responses": {"200": {"description": summary}, **errors},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
