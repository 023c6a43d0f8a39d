"""`/v1/completions` (OpenAI's legacy completions): prompts as text or token ids, n samples each, echo and legacy
logprobs, whole or streamed as text_completion chunks. The handler's stages are handler.py's."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.io import GenerateOutput, GenerateRequest, OutputMeta
from radixserve.server.errors import bad_request
from radixserve.server.handler import (
    MAX_TOP_LOGPROBS,
    Job,
    accumulate,
    check_model,
    event_stream,
    finish_reason,
    folded,
    json_response,
    max_tokens,
    observe_and_remember,
    parse,
    pin_first,
    run,
    sampling_dict,
    start_streams,
    usage,
)
from radixserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from radixserve.server.retention_hints import hinted
from radixserve.server.serving import ServerState, Stream, admit, cache_salt, merged, scheduling, sse
from radixserve.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint


async def completions(request: Request) -> Response:
    state, req = await parse(request, CompletionRequest)
    job, texts = await completion_job(request, state, req)
    created = int(time.time())
    want_lp = req.logprobs is not None
    if req.stream:
        streams = await start_streams(request, state, job, "prompt")
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = completion_events(state, job, streams, created, texts, req.echo, want_lp, include_usage)
        return event_stream(state, job, streams, events)

    outs = [o for per_prompt in await run(request, state, job, "prompt") for o in per_prompt]
    tok = state.engine.tokenizer
    choices = []
    for k, o in enumerate(outs):
        head = texts[k // req.n] if req.echo else ""
        lp = completion_logprobs(tok, o.meta_info, req.echo and want_lp, 0) if want_lp else None
        choices.append(CompletionChoice(k, head + o.text, finish_reason(o.finish_reason), lp))
    observe_and_remember(state, job, outs, chat=False)
    return json_response(state, CompletionResponse(job.rid, created, state.model_name, choices, usage(outs, req.n)))


# ---------------------------------------------------------------- build


async def completion_job(request: Request, state: ServerState, req: CompletionRequest) -> tuple[Job, list[str | None]]:
    """The engine calls, one per prompt (each with n samples), and each prompt's text to echo (None: not echoed)."""
    check_model(state, req.model)
    prompts = completion_prompts(req.prompt)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.logprobs}", param="logprobs")
    tok = state.engine.tokenizer
    ids_list = await asyncio.to_thread(lambda: [tok.encode(p) if isinstance(p, str) else p for p in prompts])
    texts = [p if isinstance(p, str) else None for p in prompts]
    longest = max(len(ids) for ids in ids_list)
    limit = max_tokens(req.max_tokens, "max_tokens", longest, state, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
    params = sampling_dict(req, limit, "max_tokens")
    await admit(state, len(prompts) * req.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    salt = cache_salt(request, req.cache_salt)
    want_lp = req.logprobs is not None
    echo_lp = req.echo and want_lp
    calls = [
        GenerateRequest(
            input_ids=ids,
            sampling_params=params,
            return_logprob=want_lp,
            logprob_start_len=0 if echo_lp else -1,
            top_logprobs_num=req.logprobs or 0,
            cache_salt=salt,
            rid=f"{rid}-{p}",
            **scheduling(request, req.priority, req.timeout),
            **hinted(req),
        )
        for p, ids in enumerate(ids_list)
    ]
    if req.pin:
        await pin_first(state, [{"input_ids": ids} for ids in ids_list], salt, "prompt")
    if req.echo:  # the text to echo: the client's string, or the decoded ids
        texts = [t if t is not None else tok.decode(ids, skip_special_tokens=False) for t, ids in zip(texts, ids_list)]
    return Job(rid, calls, req.n, salt, req.skip_special_tokens, "max_tokens"), texts


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids -> one entry per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
    ):
        return [list(p) for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of such lists", param="prompt"
    )


# ---------------------------------------------------------------- shape


def completion_logprobs(tok: Tokenizer, meta: OutputMeta, with_prompt: bool, offset: int) -> CompletionLogprobs:
    """Legacy logprobs: token strings, their logprobs, top alternatives as {token: logprob}, character offsets."""
    pairs: list[tuple[tuple[float | None, int], list | None]] = []
    if with_prompt:
        inp = meta.input_token_logprobs or []
        pairs += zip(inp, meta.input_top_logprobs or [None] * len(inp))
    out = meta.output_token_logprobs or []
    pairs += zip(out, meta.output_top_logprobs or [[] for _ in out])
    res = CompletionLogprobs([], [], [], [])
    for (lp, tid), top in pairs:
        s = tok.token_to_str(tid)
        res.tokens.append(s)
        res.token_logprobs.append(lp)
        res.top_logprobs.append(None if top is None else {tok.token_to_str(t): v for v, t in top})
        res.text_offset.append(offset)
        offset += len(s)
    return res


async def completion_events(
    state: ServerState,
    job: Job,
    streams: list[Stream],
    created: int,
    texts: list[str | None],
    echo: bool,
    logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE of text_completion chunks (choice index = prompt * n + sample), then usage if asked, then [DONE]."""
    tok = state.engine.tokenizer
    acc: list[GenerateOutput | None] = [None] * len(streams)
    offsets = [0] * len(streams)

    def chunk(choices: list[CompletionChoice], use: Usage | None = None) -> bytes:
        return sse(state, CompletionResponse(job.rid, created, state.model_name, choices, use))

    async with contextlib.aclosing(merged(streams)) as events:
        async for i, c in events:
            first = acc[i] is None
            acc[i] = accumulate(acc[i], c)
            meta = c.meta_info
            text = c.text
            if echo and first:
                text = (texts[i // job.n] or "") + text
            lp = None
            if logprobs:
                lp = completion_logprobs(tok, meta, echo and first, offsets[i])
                offsets[i] += sum(len(s) for s in lp.tokens)
            reason = finish_reason(meta.finish_reason)
            if text or lp is not None or reason is not None:
                yield chunk([CompletionChoice(i, text, reason, lp)])
    if include_usage:
        yield chunk([], usage(folded(acc), job.n))
    observe_and_remember(state, job, folded(acc), chat=False)
