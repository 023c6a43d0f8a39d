"""The shared base of the generation handlers: every endpoint that runs the model is one module whose handler reads
top to bottom in the same four stages, calling what this module gives them.

1. parse: `parse(request, Body)` -> the server state and the decoded body (413 past the size limit, 400 naming the
   field that does not validate).
2. build: the body -> a `Job`, the engine calls with everything validated now, so that errors name the fields as the
   client sent them (`check_model`, `sampling_dict`, `max_tokens`), admitted to the queue (`serving.admit`), its
   prompts pinned first if it asks (`pin_first`).
3. run: `run(...)` -> the outputs, or `start_streams(...)` -> the open engine streams (their input accepted, so a bad
   request still gets its status line).
4. shape: the outputs -> `json_response(...)`, or the streams' events -> `event_stream(...)`, which reports a failure
   part way as an error event and ends with [DONE]; `observe_and_remember` records the outputs (metrics, and a chat
   answer for the next turn's prompt).

Chat Completions builds and runs its job in chat_job.py, shared with the APIs converted to it (turns.py); /generate
keeps SGLang's own shapes and calls serving.py's engine calls itself. Every engine call is raced against the client's
disconnect (serving.py), so a client that leaves gets its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixserve.io import FinishReason, GenerateOutput, GenerateRequest, StreamChunk
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import ApiError, ErrorBody, ErrorDetail, bad_request
from radixserve.server.protocol import PromptTokensDetails, SamplingFields, Usage
from radixserve.server.serving import (
    SSE_DONE,
    EventStream,
    ServerState,
    Stream,
    aborted,
    close_streams,
    engine_errors,
    generate,
    in_band,
    open_streams,
    read_json,
    server_state,
    sse,
)

T = TypeVar("T")
MAX_N = 128
MAX_TOP_LOGPROBS = 20
# Any server answers to "default" as well as its model's name: clients and examples need not know which model runs.
DEFAULT_MODEL_ALIAS = "default"


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


# ---------------------------------------------------------------- parse


async def parse(request: Request, body: type[T]) -> tuple[ServerState, T]:
    """The server's state and the request's body decoded into `body`."""
    return server_state(request), await read_json(request, body)


# ---------------------------------------------------------------- build


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


async def pin_first(state: ServerState, prompts: list[dict], salt: str, param: str) -> None:
    """`pin: true` on a generation request: pin each prompt ({"prompt": text} or {"input_ids": ids}) before the
    generation, which then hits the pinned pages; 400 naming `param` if a pin cannot be made."""
    with engine_errors(param):
        for p in prompts:
            await asyncio.to_thread(state.engine.pin, **p, cache_salt=salt)


# ---------------------------------------------------------------- run


async def run(request: Request, state: ServerState, job: Job, default_param: str) -> list[list[GenerateOutput]]:
    """The job's outputs, one list (its n samples) per engine call; engine errors name the client's fields."""
    with engine_errors(default_param, {"max_new_tokens": job.max_param, **job.renames}):
        return await generate(request, state, job.calls)


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


# ---------------------------------------------------------------- shape


def json_response(state: ServerState, body: Any) -> Response:
    return Response(state.json.encode(body), media_type="application/json")


def event_stream(state: ServerState, job: Job, streams: list[Stream], events: AsyncIterator[bytes]) -> EventStream:
    """The SSE response of a job's streams; `events` are the API's own (guarded_events adds errors and [DONE])."""
    return EventStream(guarded_events(state, job, streams, events))


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


def observe_and_remember(state: ServerState, job: Job, outs: list[GenerateOutput], chat: bool) -> None:
    for o in outs:
        state.metrics.observe(o.meta_info)
        if chat:
            state.prompts.remember(job.salt, o.text, o.output_ids, o.finish_reason, job.skip_special_tokens)


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


def error_event(state: ServerState, err: ApiError) -> bytes:
    return sse(state, ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code)))
