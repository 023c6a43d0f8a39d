"""A chat request into its engine job, and the job's run: messages (tool calls and tool results included) through
the chat template, `response_format` (json_object, json_schema) and `tools` + `tool_choice` as grammars, the
tool-call format to parse the output with (radixserve/server/tool_calls.py). The build and run stages of
/v1/chat/completions (chat_api.py) and of the APIs converted to it (turns.py: Responses, Messages)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from radixserve.io import GenerateOutput, GenerateRequest
from radixserve.server.agent_retention import gap_group
from radixserve.server.call_stop import CallWatch, collect
from radixserve.server.errors import bad_request
from radixserve.server.handler import MAX_TOP_LOGPROBS, Job, check_model, max_tokens, pin_first, run, sampling_dict
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage
from radixserve.server.reasoning import ThinkSplit, think_split
from radixserve.server.retention_hints import hinted
from radixserve.server.serving import ServerState, admit, cache_salt, engine_errors, scheduling
from radixserve.server.tool_calls import ToolFormat, call_key, tool_format
from radixserve.server.tool_grammar import after_reasoning, call_grammar, lazy_grammar
from radixserve.tokenizer import Tokenizer

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Engine grammar fields as the client named them: a bad schema in response_format is reported there.
GRAMMAR_RENAMES = {"json_schema": "response_format", "ebnf": "tools"}
# Template variables the request sets through its own fields; chat_template_kwargs may not set them again.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass
class Structure:
    """What a chat request asks of its output's shape: a grammar for the engine, tools for the template, and the
    tool-call format to parse the output with (None: the output is plain content)."""

    grammar: dict[str, Any]
    tools: list[dict[str, Any]] | None
    parser: ToolFormat | None
    calls_first: bool = False  # the grammar makes the output begin with its calls (tool_choice required or named)


# ---------------------------------------------------------------- messages, tools, response_format


def _content(m: ChatMessage, i: int) -> str | None:
    content = m.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"unsupported content part type {part.type!r}; only text parts are supported",
                    param=f"messages[{i}].content[{j}].type",
                )
        content = "\n".join(part.text for part in content)  # type: ignore[misc]
    return content


def _calls(m: ChatMessage, i: int) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls as templates take them (arguments as an object, as transformers passes)."""
    calls = []
    for j, c in enumerate(m.tool_calls or []):
        try:
            args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(
                "arguments must be JSON text", param=f"messages[{i}].tool_calls[{j}].function.arguments"
            ) from None
        calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return calls


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: roles checked, content parts joined, tool calls and results kept."""
    if not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"unsupported role {m.role!r}; use system, user, assistant or tool", param=f"messages[{i}].role"
            )
        content = _content(m, i)
        if role == "tool" and m.tool_call_id is None:
            raise bad_request("a tool message needs the tool_call_id it answers", param=f"messages[{i}].tool_call_id")
        if content is None:
            if role != "assistant":
                raise bad_request("content is required", param=f"messages[{i}].content")
            content = ""
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = _calls(m, i)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _response_format(req: ChatCompletionRequest) -> dict[str, Any]:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format json_schema needs a schema", param="response_format.json_schema")
        return {"json_schema": rf.json_schema.schema}
    raise bad_request(
        f"unsupported response_format type {rf.type!r}; use text, json_object or json_schema",
        param="response_format.type",
    )


def _tool_choice(req: ChatCompletionRequest) -> str | None:
    """'auto', 'none', 'required', or the name of the one function to call."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice must be auto, none, required or a named function, got {choice!r}", param="tool_choice"
            )
        if choice == "required" and not req.tools:
            raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
        return choice
    names = {t.function.name for t in req.tools or []}
    if choice.function.name not in names:
        raise bad_request(
            f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
        )
    return choice.function.name


def _answered(messages: list[ChatMessage]) -> frozenset[tuple[str, str]]:
    """The calls of the last assistant turn, when only their results follow it (tool_calls.CallList)."""
    for m in reversed(messages):
        if m.role == "assistant":
            return frozenset(call_key(c.function.name, c.function.arguments) for c in m.tool_calls or [])
        if m.role != "tool":
            break
    return frozenset()


def structure(req: ChatCompletionRequest, tok: Tokenizer) -> Structure:
    """The grammar, template tools and output parser a chat request asks for (400 naming the field if it cannot)."""
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise bad_request(f"unsupported tool type {t.type!r}; use function", param=f"tools[{i}].type")
    choice = _tool_choice(req)
    tools = [
        {
            "type": "function",
            "function": {
                k: v
                for k, v in (
                    ("name", t.function.name),
                    ("description", t.function.description),
                    ("parameters", t.function.parameters),
                )
                if v is not None
            },
        }
        for t in req.tools or []
    ] or None
    parallel = req.parallel_tool_calls is not False
    names = frozenset(t.function.name for t in req.tools or [])
    fmt = tool_format(tok, names, parallel, _answered(req.messages)) if tools else None
    if tools and fmt is None:
        raise bad_request("this model's chat template has no tool-call format", param="tools")
    if choice == "none" or fmt is None:
        return Structure(_response_format(req), tools, None)
    assert tools is not None
    if choice == "auto":
        answer = _response_format(req).get("json_schema")
        if answer is None:  # free text, but a call that starts is held to a declared tool (lazy grammar)
            return Structure({"ebnf": lazy_grammar(fmt, tools, parallel)}, tools, fmt)
        # As OpenAI: response_format shapes the final text answer only; the turn may still call a tool instead.
        return Structure({"ebnf": call_grammar(fmt, tools, None, parallel, answer=answer)}, tools, fmt, True)
    grammar = call_grammar(fmt, tools, None if choice == "required" else choice, parallel)
    return Structure({"ebnf": grammar}, tools, fmt, True)


# ---------------------------------------------------------------- build and run


async def prompt_ids(
    request: Request, state: ServerState, req: ChatCompletionRequest
) -> tuple[list[int], Structure, str]:
    """The chat request's prompt ids (template, tools and remembered answers), its structure and cache namespace."""
    check_model(state, req.model)
    messages = chat_messages(req.messages)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}", param="top_logprobs"
            )
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    reserved = RESERVED_TEMPLATE_VARS & set(req.chat_template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    shape = structure(req, state.engine.tokenizer)
    salt = cache_salt(request, req.cache_salt)
    with engine_errors("messages"):
        ids = await asyncio.to_thread(state.prompts.build, messages, salt, shape.tools, req.chat_template_kwargs)
    think = think_split(state.reasoning_parser, state.engine.tokenizer, ids)
    if shape.calls_first and shape.parser is not None and think is not None and think.state == "reasoning":
        # The template opened a reasoning block (Qwen3): the calls come after the model closes it.
        shape.grammar = {"ebnf": after_reasoning(shape.grammar["ebnf"], shape.parser)}
    return ids, shape, salt


async def prepare_chat(
    request: Request, state: ServerState, req: ChatCompletionRequest, rid: str
) -> tuple[Job, Structure]:
    """Validate a chat request and build its engine call: the one path into the engine for Chat Completions and the
    APIs converted to it (Responses, Messages)."""
    ids, shape, salt = await prompt_ids(request, state, req)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_dict(req, max_tokens(limit, max_param, len(ids), state, None, "messages"), max_param)
    params.update(shape.grammar)
    await admit(state, req.n)
    call = GenerateRequest(
        input_ids=ids,
        sampling_params=params,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        cache_salt=salt,
        rid=rid,
        **scheduling(request, req.priority, req.timeout),
        **hinted(req),
    )
    if req.pin:
        await pin_first(state, [{"input_ids": ids}], salt, "messages")
    group = gap_group(state, req, call.tenant, salt)
    return Job(rid, [call], req.n, salt, req.skip_special_tokens, max_param, dict(GRAMMAR_RENAMES), group), shape


def thinking(state: ServerState, job: Job) -> ThinkSplit | None:
    """A fresh reasoning splitter for one of the job's outputs (None: the model does not think)."""
    return think_split(state.reasoning_parser, state.engine.tokenizer, job.calls[0].input_ids)


async def run_chat(request: Request, state: ServerState, job: Job, shape: Structure) -> list[GenerateOutput]:
    """The job's outputs, one per sample. With a tool-call parser each is read as a stream, to stop where its call
    list closes (call_stop.py), as a streamed answer does."""
    if shape.parser is None:
        [outs] = await run(request, state, job, "messages")
        return outs
    with engine_errors("messages", {"max_new_tokens": job.max_param, **job.renames}):
        return await collect(request, state, job, [CallWatch(shape.parser, thinking(state, job)) for _ in range(job.n)])
