"""Messages API <-> the chat path: system, messages and their blocks to chat messages, the request to a
ChatCompletionRequest, and a Turn back to content blocks and a stop reason."""

from __future__ import annotations

import json
import uuid
from typing import Any

from radixserve.server.errors import bad_request
from radixserve.server.messages_protocol import (
    Block,
    ContentBlock,
    MessagesRequest,
    PromptFields,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from radixserve.server.retention_hints import CACHE_CONTROL_TTL, longest_ttl
from radixserve.server.protocol import (
    CacheControl,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    JsonSchemaFormat,
    Tool,
)
from radixserve.server.tool_calls import ToolCall
from radixserve.server.turns import Turn

# A chat or engine field -> the name a Messages client knows it by.
NAMES = {
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "ebnf": "tools",
    "json_schema": "output_config.format",
    "response_format": "output_config.format",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
DROPPED = frozenset({"thinking", "redacted_thinking"})  # earlier reasoning: templates leave it out of the prompt


def _joined(blocks: str | list[Block] | None, param: str) -> str:
    """The text of a string or of text blocks (a tool_result's content, the system prompt)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise bad_request(f"unsupported block type {b.type!r} here; only text blocks", f"{param}.{j}.type")
    return "\n".join(b.text or "" for b in blocks)


def _user(blocks: list[Block], at: str) -> list[ChatMessage]:
    """A user turn: its tool_result blocks become tool messages, its text one user message after them."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        if b.type == "tool_result":
            if b.tool_use_id is None:
                raise bad_request("a tool_result needs the tool_use_id it answers", f"{at}.{j}.tool_use_id")
            out.append(
                ChatMessage(role="tool", content=_joined(b.content, f"{at}.{j}.content"), tool_call_id=b.tool_use_id)
            )
        elif b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type not in DROPPED:
            raise bad_request(f"unsupported block type {b.type!r}; use text or tool_result", f"{at}.{j}.type")
    return out + ([ChatMessage(role="user", content="\n".join(texts))] if texts else [])


def _assistant(blocks: list[Block], at: str) -> ChatMessage:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        if b.type == "tool_use":
            if b.id is None or b.name is None:
                raise bad_request("a tool_use block needs its id and name", f"{at}.{j}")
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            calls.append(MessageToolCall(id=b.id, function=FunctionCall(b.name, arguments)))
        elif b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type not in DROPPED:
            raise bad_request(f"unsupported block type {b.type!r}; use text or tool_use", f"{at}.{j}.type")
    return ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)


def chat_messages(req: PromptFields) -> list[ChatMessage]:
    system = _joined(req.system, "system")
    out = [ChatMessage(role="system", content=system)] if system else []
    for i, m in enumerate(req.messages):
        at = f"messages.{i}.content"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"unsupported role {m.role!r}; use user or assistant", f"messages.{i}.role")
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
        else:
            out += _user(m.content, at) if m.role == "user" else [_assistant(m.content, at)]
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    return out


def _tools(req: PromptFields) -> list[Tool] | None:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise bad_request(f"unsupported tool type {t.type!r}; only custom tools are served", f"tools.{i}.type")
        tools.append(Tool(type="function", function=FunctionDef(t.name, t.description, t.input_schema, t.strict)))
    return tools or None


def _tool_choice(req: PromptFields) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice of type tool needs a name", param="tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(choice.name))
    named = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if named is None:
        raise bad_request(f"tool_choice type must be auto, any, tool or none, got {choice.type!r}", "tool_choice.type")
    return named


def _thinking(req: PromptFields) -> dict[str, Any] | None:
    """`thinking` as thinking templates take it (Qwen3's enable_thinking); without it, the template's default."""
    if req.thinking is None:
        return None
    if req.thinking.type not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"thinking type must be enabled or disabled, got {req.thinking.type!r}", "thinking.type")
    return {"enable_thinking": req.thinking.type != "disabled"}


def chat_request(req: PromptFields) -> ChatCompletionRequest:
    """The chat request for the prompt fields; the sampling fields too when `req` is a MessagesRequest."""
    cache_ttl(req)  # a bad cache_control is refused on every endpoint
    parallel = None if req.tool_choice is None else not req.tool_choice.disable_parallel_tool_use
    chat = ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req),
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=parallel,
        chat_template_kwargs=_thinking(req),
    )
    if not isinstance(req, MessagesRequest):
        return chat
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    chat.max_tokens = req.max_tokens
    chat.temperature, chat.top_p, chat.top_k, chat.seed = req.temperature, req.top_p, req.top_k, req.seed
    chat.stop, chat.metadata, chat.cache_salt = req.stop_sequences, req.metadata, req.cache_salt
    chat.priority, chat.timeout, chat.stream = req.priority, req.timeout, req.stream
    chat.response_format = _output_format(req)
    chat.retention_seconds = CACHE_CONTROL_TTL[cache_ttl(req)] if _controls(req) else None
    return chat


def _output_format(req: MessagesRequest) -> ResponseFormat | None:
    """Structured output (`output_config.format`) as Chat Completions' json_schema response_format."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema" or fmt.schema is None:
        raise bad_request("output_config.format must be {type: json_schema, schema}", param="output_config.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema))


def _controls(req: PromptFields) -> list[CacheControl]:
    """Every cache_control of the request: on the request, system blocks, message blocks (tool results' too), tools."""
    blocks = [b for m in req.messages if not isinstance(m.content, str) for b in m.content]
    blocks += [c for b in blocks if isinstance(b.content, list) for c in b.content]
    blocks += req.system if isinstance(req.system, list) else []
    found = [b.cache_control for b in blocks] + [t.cache_control for t in req.tools or []]
    found.append(req.cache_control if isinstance(req, MessagesRequest) else None)
    return [c for c in found if c is not None]


def cache_ttl(req: PromptFields) -> str:
    """The longest cache_control ttl the request asks for ("5m" unless one says "1h"): what it wrote under, and with
    any marker, how long its prefix is retained (retention_hints.py)."""
    return longest_ttl(_controls(req)) or "5m"


def tool_input(call: ToolCall) -> Any:
    """A call's arguments as the JSON value Anthropic's `input` holds (the parser gives JSON text)."""
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def content_blocks(turn: Turn) -> list[ContentBlock]:
    blocks: list[ContentBlock] = [ThinkingBlock(turn.reasoning)] if turn.reasoning else []
    blocks += [TextBlock(turn.text)] if turn.text else []
    return blocks + [ToolUseBlock(c.id, c.name, tool_input(c)) for c in turn.calls]


def stop_reason(turn: Turn) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished turn."""
    if turn.reason == "stop" and turn.stop_string is not None:
        return "stop_sequence", turn.stop_string
    return STOP_REASONS.get(turn.reason, "end_turn"), None
