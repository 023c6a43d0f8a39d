"""Responses API <-> the chat path: input items to chat messages, the request to a ChatCompletionRequest, and a Turn
back to output items (and to the assistant message a stored conversation continues with)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from radixserve.server.errors import bad_request
from radixserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)
from radixserve.server.responses_protocol import (
    FunctionCallItem,
    InputItem,
    InputPart,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
)
from radixserve.server.turns import Turn

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Engine grammar fields as a Responses client names them.
NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_new_tokens": "max_output_tokens",
    "response_format": "text.format",
    "json_schema": "text.format",
    "ebnf": "tools",
}


def _text(content: str | list[InputPart] | None, param: str) -> str:
    if content is None:
        raise bad_request("content is required", param=param)
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(
                f"unsupported content part type {part.type!r}; only text parts are supported", f"{param}[{j}].type"
            )
    return "\n".join(part.text or "" for part in content)


def _required(value: str | None, param: str) -> str:
    if value is None:
        raise bad_request(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    return value


def input_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """Chat messages for the request's input: a string is one user message; function_call items join the assistant
    message before them (the template writes a turn's text and its calls together); reasoning items are dropped."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if item.type == "message":
            if item.role not in MESSAGE_ROLES:
                raise bad_request(
                    f"unsupported role {item.role!r}; use user, assistant, system or developer", f"{at}.role"
                )
            out.append(ChatMessage(role=item.role, content=_text(item.content, f"{at}.content")))
        elif item.type == "function_call":
            call = MessageToolCall(
                id=_required(item.call_id, f"{at}.call_id"),
                function=FunctionCall(_required(item.name, f"{at}.name"), _required(item.arguments, f"{at}.arguments")),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            output = _text(item.output, f"{at}.output")
            out.append(ChatMessage(role="tool", content=output, tool_call_id=_required(item.call_id, f"{at}.call_id")))
        elif item.type != "reasoning":
            raise bad_request(
                f"unsupported input item type {item.type!r}; use message, function_call or function_call_output",
                f"{at}.type",
            )
    return out


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise bad_request(f"unsupported tool type {t.type!r}; only function tools are served", f"tools[{i}].type")
        name = _required(t.name, f"tools[{i}].name")
        tools.append(Tool(type="function", function=FunctionDef(name, t.description, t.parameters, t.strict)))
    return tools or None


def _tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(choice.name))


def _format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise bad_request("text.format json_schema needs a schema", param="text.format.schema")
        schema = JsonSchemaFormat(name=fmt.name or "response", schema=fmt.schema, description=fmt.description)
        return ResponseFormat(type="json_schema", json_schema=schema)
    raise bad_request(
        f"unsupported text.format type {fmt.type!r}; use text, json_object or json_schema", "text.format.type"
    )


def _thinking(req: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` as thinking templates take it (Qwen3's enable_thinking): "none" turns thinking off."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    return None if effort is None else {"enable_thinking": effort != "none"}


def chat_request(req: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request for this turn: `instructions` (never carried over from a previous response, as OpenAI does)
    as the system message, then the conversation."""
    if not conversation:
        raise bad_request("input must not be empty", param="input")
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    return ChatCompletionRequest(
        model=req.model,
        messages=system + conversation,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        cache_salt=req.cache_salt,
        priority=req.priority,
        timeout=req.timeout,
        prompt_cache_key=req.prompt_cache_key,
        prompt_cache_retention=req.prompt_cache_retention,
        response_format=_format(req),
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=_thinking(req),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str) -> MessageItem:
    return MessageItem(new_id("msg"), [OutputText(text)])


def call_item(call_id: str, name: str, arguments: str) -> FunctionCallItem:
    return FunctionCallItem(new_id("fc"), call_id, name, arguments)


def reasoning_item(text: str) -> ReasoningItem:
    return ReasoningItem(new_id("rs"), [ReasoningText(text)])


def turn_items(turn: Turn) -> list[OutputItem]:
    items: list[OutputItem] = [reasoning_item(turn.reasoning)] if turn.reasoning else []
    items += [message_item(turn.text)] if turn.text else []
    return items + [call_item(c.id, c.name, c.arguments) for c in turn.calls]


def assistant_message(items: list[OutputItem]) -> ChatMessage:
    """The output as the assistant message the next turn's prompt renders (text and calls in one message)."""
    text = "".join(p.text for it in items if isinstance(it, MessageItem) for p in it.content)
    calls = [
        MessageToolCall(id=it.call_id, function=FunctionCall(it.name, it.arguments))
        for it in items
        if isinstance(it, FunctionCallItem)
    ]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)
