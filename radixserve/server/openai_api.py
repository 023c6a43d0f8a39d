"""OpenAI-compatible endpoints: /v1/completions, /v1/models, and what /v1/chat/completions (chat_api.py) shares."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixserve.io import FinishReason, GenerateOutput, GenerateRequest, OutputMeta, StreamChunk
from radixserve.sampling_params import SamplingParams
from radixserve.server.cache_api import pin_first
from radixserve.server.errors import ApiError, ErrorBody, ErrorDetail, bad_request
from radixserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from radixserve.server.retention_hints import hinted
from radixserve.server.serving import (
    SSE_DONE,
    EventStream,
    ServerState,
    Stream,
    aborted,
    admit,
    cache_salt,
    close_streams,
    engine_errors,
    in_band,
    generate,
    merged,
    open_streams,
    read_json,
    scheduling,
    server_state,
    sse,
)
from radixserve.tokenizer import Tokenizer

MAX_N = 128
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint


@dataclass
class Job:
    """One validated generation request, ready for the engine: one engine call per prompt (each with n samples)."""

    rid: str
    calls: list[GenerateRequest]
    n: int
    salt: str
    skip_special_tokens: bool
    max_param: str  # the name the client used for the token limit, for error messages
    renames: dict[str, str] = field(default_factory=dict)  # engine field -> the client's name, for error messages
    group: str = ""  # chat: its group for agent retention's tool gaps (radixserve/server/agent_retention.py)


# ---------------------------------------------------------------- shared validation

# Any server answers to "default" as well as its model's name: clients and examples need not know which model runs.
DEFAULT_MODEL_ALIAS = "default"


def check_model(state: ServerState, model: str | None) -> None:
    if model and model not in (state.model_name, state.model_path, DEFAULT_MODEL_ALIAS):
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
            type="not_found_error",
        )


def sampling_dict(req: SamplingFields, max_new_tokens: int, max_param: str) -> dict[str, Any]:
    """Engine sampling params from the request's OpenAI fields, validated now so errors use the client's names."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise bad_request(f"seed must be in [0, 2**63), got {req.seed}", param="seed")
    d = {
        "max_new_tokens": max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "logit_bias": req.logit_bias,
        "min_new_tokens": req.min_tokens,
        "stop_regex": req.stop_regex,
        "no_stop_trim": req.no_stop_trim,
        "seed": req.seed,
        "n": req.n,
    }
    d = {k: v for k, v in d.items() if v is not None}
    with engine_errors(None, {"max_new_tokens": max_param, "min_new_tokens": "min_tokens"}):
        SamplingParams.from_dict(d)
    return d


def max_tokens(
    value: int | None, param: str, prompt_len: int, state: ServerState, default: int | None, prompt_param: str
) -> int:
    """The token limit: the client's, else `default`, else all the room the context and the pool leave."""
    if value is not None:
        if value < 0:
            raise bad_request(f"{param} must be >= 0, got {value}", param=param)
        return value
    room = min(state.context_length, state.pool_tokens) - prompt_len
    if room <= 0:
        raise bad_request(
            f"prompt of {prompt_len} tokens leaves no room to generate in the context of "
            f"{min(state.context_length, state.pool_tokens)} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return room if default is None else min(default, room)


def fan_out(job: Job) -> list[GenerateRequest]:
    """One stream per sample (engine streams take n == 1): sample i of a prompt seeds with seed + i, as the engine does."""
    calls = []
    for call in job.calls:
        for i in range(job.n):
            params = dict(call.sampling_params, n=1)
            if "seed" in params:
                params["seed"] += i
            rid = call.rid if job.n == 1 else f"{call.rid}-{i}"
            calls.append(replace(call, sampling_params=params, rid=rid))
    return calls


async def start_streams(request: Request, state: ServerState, job: Job, default_param: str) -> list[Stream]:
    """Open the job's streams; with n > 1 each prompt is prefilled once first, so its samples share the cached pages."""
    with engine_errors(default_param, {"max_new_tokens": job.max_param, **job.renames}):
        if job.n > 1:
            prefill = [
                replace(
                    c,
                    sampling_params=dict(c.sampling_params, max_new_tokens=0, n=1),
                    return_logprob=False,
                    logprob_start_len=-1,
                    rid=f"{c.rid}-prefill",
                )
                for c in job.calls
            ]
            await generate(request, state, prefill)
        return await open_streams(request, state, fan_out(job))


def usage(outs: list[GenerateOutput], per_prompt: int) -> Usage:
    """Prompt tokens (and their cached part) count once per prompt; completion tokens count per sample."""
    firsts = [o.meta_info for o in outs[::per_prompt]]
    prompt = sum(m.prompt_tokens for m in firsts)
    completion = sum(o.meta_info.completion_tokens for o in outs)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(sum(m.cached_tokens for m in firsts)))


def finish_reason(fin: FinishReason | None) -> str | None:
    if fin is None:
        return None
    if fin.type == "abort":
        raise aborted(fin)
    return fin.type


def error_event(state: ServerState, err: ApiError) -> bytes:
    return sse(state, ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code)))


def observe_and_remember(state: ServerState, job: Job, outs: list[GenerateOutput], chat: bool) -> None:
    for o in outs:
        state.metrics.observe(o.meta_info)
        if chat:
            state.prompts.remember(job.salt, o.text, o.output_ids, o.finish_reason, job.skip_special_tokens)


def accumulate(acc: GenerateOutput | None, chunk: StreamChunk) -> GenerateOutput:
    """Fold a stream chunk into acc (None before the first), so that it ends as the non-streaming output would be;
    counts in meta_info are cumulative already."""
    if acc is None:
        return GenerateOutput(chunk.text, list(chunk.output_ids), chunk.meta_info)
    meta, before = chunk.meta_info, acc.meta_info
    if before.output_token_logprobs:  # a chunk's output logprobs are its own tokens': the whole output has them all
        meta = msgspec.structs.replace(
            meta,
            output_token_logprobs=before.output_token_logprobs + (meta.output_token_logprobs or []),
            output_top_logprobs=(before.output_top_logprobs or []) + (meta.output_top_logprobs or [])
            if before.output_top_logprobs is not None or meta.output_top_logprobs is not None
            else None,
        )
    return GenerateOutput(acc.text + chunk.text, acc.output_ids + chunk.output_ids, meta)


def folded(acc: list[GenerateOutput | None]) -> list[GenerateOutput]:
    """Every stream's whole output, once all have finished (a stream always yields at least one chunk)."""
    assert all(a is not None for a in acc)
    return acc  # type: ignore[return-value]


# ---------------------------------------------------------------- logprobs


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


# ---------------------------------------------------------------- /v1/completions


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


async def completions(request: Request) -> Response:
    state = server_state(request)
    req = await read_json(request, CompletionRequest)
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
    job = Job(rid, calls, req.n, salt, req.skip_special_tokens, "max_tokens")
    created = int(time.time())
    if req.echo:  # the text to echo: the client's string, or the decoded ids
        texts = [t if t is not None else tok.decode(ids, skip_special_tokens=False) for t, ids in zip(texts, ids_list)]
    if req.stream:
        streams = await start_streams(request, state, job, "prompt")
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = completion_events(state, job, streams, created, texts, req.echo, want_lp, include_usage)
        return EventStream(guarded_events(state, job, streams, events))

    with engine_errors("prompt", {"max_new_tokens": "max_tokens"}):
        results = await generate(request, state, calls)
    outs = [o for per_prompt in results for o in per_prompt]
    choices = []
    for k, o in enumerate(outs):
        head = texts[k // req.n] if req.echo else ""
        lp = completion_logprobs(tok, o.meta_info, echo_lp, 0) if want_lp else None
        choices.append(CompletionChoice(k, head + o.text, finish_reason(o.finish_reason), lp))
    observe_and_remember(state, job, outs, chat=False)
    body = CompletionResponse(rid, created, state.model_name, choices, usage(outs, req.n))
    return Response(state.json.encode(body), media_type="application/json")


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


async def guarded_events(
    state: ServerState, job: Job, streams: list[Stream], events: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """An SSE body's events, then [DONE]: an error part way becomes an error event (the status line is gone by
    then), and the engine streams are closed however the body ends."""
    try:
        async with contextlib.aclosing(events) as body:  # type: ignore[type-var]
            async for event in body:
                yield event
    except ApiError as err:
        yield error_event(state, err)
    except Exception as exc:
        yield error_event(state, in_band(exc, job.renames))
    finally:
        await close_streams(state.engine, streams)
    yield SSE_DONE


# ---------------------------------------------------------------- /v1/models


async def models(request: Request) -> Response:
    state = server_state(request)
    defaults = state.engine.sampling_defaults
    body = ModelList(
        [
            ModelCard(
                state.model_name, state.created, max_model_len=state.context_length, sampling_defaults=defaults or None
            )
        ]
    )
    return Response(state.json.encode(body), media_type="application/json")
