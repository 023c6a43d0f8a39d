"""The Engine API: submit requests from any thread or event loop; one background thread runs the scheduler loop."""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from radixserve.errors import ParamError, QueueFullError
from radixserve.model.cpu_select import choose
from radixserve.model.resolve import resolve_model
from radixserve.engine_config import EngineConfig
from radixserve.engine_loop import EngineLoop
from radixserve.inputs import RequestBuilder, RequestSpec
from radixserve.model.sampling_defaults import load_sampling_defaults
from radixserve.model.runner import ModelRunner, default_attention_backend
from radixserve.request import Req
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured on the default model (2 AVX-512 cores, benchmarks/prefill_step_cost.py): a step costs ~59 ms plus ~2.2 ms
# per prefill token, so merging prefills pays only below ~27 tokens each; 32 leans a little toward throughput.
_CPU_PREFILL_MERGE_TOKENS = 32


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], item: Any) -> None:
    """Hand a result to the caller's event loop from the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, item)
    except RuntimeError:
        pass  # that loop has closed: its caller left (its request was aborted), so nobody waits for this


class Engine:
    """In-process LLM engine with a radix prefix cache; thread-safe, usable from sync code and from event loops."""

    def __init__(self, config: EngineConfig | str | Path | None = None, **settings: Any) -> None:
        """`Engine(EngineConfig(...))`, or the same settings as keywords (`Engine(model=..., dtype=...)`); a first
        positional str or Path is the model."""
        if not isinstance(config, EngineConfig):
            if config is not None:
                settings = {"model": config, **settings}
            config = EngineConfig.from_kwargs(settings)
        elif settings:
            raise TypeError("pass an EngineConfig or keyword settings, not both")
        self.config = c = config
        # "auto" dtype and quantization resolved by what the CPU has (radixserve/model/cpu_select.py)
        self.cpu_choice = choose(c.dtype, c.quantization, torch.device(c.device).type)
        dtype, self.quantization = self.cpu_choice.dtype, self.cpu_choice.quantization
        self.model_path = resolve_model(None if c.model is None else str(c.model))
        self.dtype_name = dtype
        self.device = torch.device(c.device)
        if self.device.type == "cuda" and self.device.index is None:  # pin it: each thread binds this same device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.attention_backend = c.attention_backend or default_attention_backend(self.device, _DTYPES[dtype])
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        # Applied to what a request leaves unset (see radixserve/model/sampling_defaults.py).
        self.sampling_defaults = load_sampling_defaults(self.model_path) if c.sampling_defaults == "model" else {}
        self.runner = ModelRunner(
            self.model_path, _DTYPES[dtype], self.device, c.page_size, c.max_total_tokens, self.attention_backend,
            c.max_running_requests, c.context_length, quantization=self.cpu_choice.weights,
        )
        cfg = self.runner.config
        # Positions past max_position_embeddings have no rotary table; attention is full (no sliding window is
        # implemented), so a windowed model is exact only up to its window.
        limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        if c.context_length is not None and c.context_length > limit:
            raise ParamError("context_length", f"context_length {c.context_length} exceeds what the model supports "
                             f"({limit})")
        self.context_length = c.context_length or limit
        self.max_queued_requests = c.max_queued_requests
        pool = self.runner.pool
        self.inputs = RequestBuilder(self.tokenizer, cfg.vocab_size, self.context_length,
                                     pool.capacity * pool.page_size, self.sampling_defaults)
        self.encode_prompts = self.inputs.encode_prompts  # the server tokenizes prompts in a thread with it
        merge = c.prefill_merge_tokens
        if merge == "auto":  # see SchedulerConfig.prefill_merge_tokens
            merge = None if self.device.type == "cuda" else _CPU_PREFILL_MERGE_TOKENS
        sched_cfg = SchedulerConfig(
            page_size=c.page_size,
            context_length=self.context_length,
            chunked_prefill_size=c.chunked_prefill_size,
            max_running_requests=c.max_running_requests,
            schedule_policy=c.schedule_policy,
            enable_radix_cache=c.enable_radix_cache,
            init_new_token_ratio=c.init_new_token_ratio,
            prefill_merge_tokens=merge,
        )
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.scheduler = Scheduler(sched_cfg, self.runner.pool, eos)

        # Overlap: a worker thread runs step N (on a GPU it only launches kernels) while the loop processes step N-1
        # and schedules N+1. On a CPU both would share the same cores, so it is off there by default.
        self.overlap_schedule = self.device.type == "cuda" if c.overlap_schedule is None else c.overlap_schedule
        self._inflight = 0  # requests submitted and not finished (the queue limit counts those not yet running)
        self._inflight_lock = threading.Lock()
        self.loop = EngineLoop(self.scheduler, self.runner, self.device, self.overlap_schedule)
        # An engine never shut down still stops its loop at interpreter exit, before torch's threads are torn down
        # under it (that aborts the process).
        weakref.finalize(self, self.loop.stop)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the loop; requests still queued or running end with finish_reason abort."""
        self.loop.stop()

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine loop, if it stopped on an error."""
        return self.loop.error

    def _reserve(self, count: int, field: str) -> None:
        """Count `count` requests in flight, all or none: QueueFullError when the waiting queue cannot take them all
        now, ParamError (naming `field`) when it never could."""
        self.loop.check_alive()
        limit = self.max_queued_requests
        if limit is not None and count > limit:
            raise ParamError(field, f"{count} requests at once can never fit the queue of {limit} (max_queued_requests)")
        with self._inflight_lock:
            waiting = self._inflight - self.loop.running_snapshot
            if limit is not None and waiting + count > limit:
                raise QueueFullError(f"{waiting} requests are already waiting (max_queued_requests {limit})")
            self._inflight += count

    def _unreserve(self, count: int) -> None:
        with self._inflight_lock:
            self._inflight -= count

    def _submit(self, spec: RequestSpec, emit: Callable[[Any], None], stream: bool) -> Req:
        """Queue one request the caller has reserved a place for (`_reserve`); the place is given back when the
        request finishes, or here if building it fails."""
        try:
            return self._build_and_queue(spec, emit, stream)
        except BaseException:
            self._unreserve(1)
            raise

    def _build_and_queue(self, spec: RequestSpec, emit: Callable[[Any], None], stream: bool) -> Req:
        def emit_and_count(item: Any) -> None:
            if isinstance(item, BaseException) or item["meta_info"]["finish_reason"] is not None:
                with self._inflight_lock:
                    self._inflight -= 1
            emit(item)

        req = self.inputs.make_req(spec, emit_and_count, stream)
        self.loop.inbox.put(("add", req))
        return req

    # ---- async API ----------------------------------------------------------------------------------------------
    def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str = "",
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> Any:
        """stream=False: an awaitable of a dict (list for list input or n > 1); stream=True: an async iterator of chunks.

        Arguments are validated here, before anything is queued, so bad input raises ValueError at the call."""
        specs, single = self.inputs.specs(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, cache_salt, rid
        )
        if stream:
            if len(specs) != 1 or specs[0].params.n != 1:
                raise ValueError("stream=True takes a single prompt with n == 1")
            return self._stream(specs[0])
        return self._collect(specs, single)

    async def _stream(self, spec: RequestSpec) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        self._reserve(1, "prompt")
        req = self._submit(spec, lambda c: _post(loop, chunks.put_nowait, c), stream=True)
        done = False
        try:
            while not done:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                done = chunk["meta_info"]["finish_reason"] is not None
                yield chunk
        finally:
            if not done:  # the caller left early (break, aclose, cancellation, disconnect)
                self.abort(req.rid)

    async def _run_one(self, spec: RequestSpec) -> dict[str, Any]:
        """Submit one request that reports only its final result, and wait for it (cancelling aborts it)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(item: Any) -> None:
            if not fut.done():
                fut.set_result(item)

        req = self._submit(spec, lambda item: _post(loop, settle, item), stream=False)
        try:
            item = await fut
        except asyncio.CancelledError:
            self.abort(req.rid)
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    async def _collect(self, specs: list[RequestSpec], single: bool) -> dict[str, Any] | list[dict[str, Any]]:
        # n > 1: prefill each prompt once (a zero-token request), so the n samples all hit its pages in the tree.
        multi = [replace(s, rid=uuid.uuid4().hex, params=s.params.replace(max_new_tokens=0, n=1), return_logprob=False)
                 for s in specs if s.params.n > 1]
        expanded: list[RequestSpec] = []
        for s in specs:
            for i in range(s.params.n):
                seed = s.params.seed + i if s.params.seed is not None else None
                rid = s.rid if s.params.n == 1 else f"{s.rid}-{i}"
                expanded.append(replace(s, rid=rid, params=s.params.replace(n=1, seed=seed)))
        # The whole batch is admitted or refused: never some members running while the caller got a 429.
        self._reserve(len(multi) + len(expanded), "n" if any(s.params.n > 1 for s in specs) else "prompt")
        unsent = len(expanded)
        try:
            if multi:
                await asyncio.gather(*(self._run_one(s) for s in multi))
            unsent = 0
            results = await asyncio.gather(*(self._run_one(s) for s in expanded))
        finally:
            self._unreserve(unsent)  # the samples never submitted (their prefill failed or was cancelled)
        return results[0] if single else list(results)

    # ---- sync API -----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str = "",
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generate: a dict for one prompt (n == 1), else a list (prompt-major, then sample)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Engine.generate blocks; inside an event loop use `await engine.async_generate(...)`")
        coro = self.async_generate(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, cache_salt, rid
        )
        return asyncio.run(coro)

    def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, **kw: Any) -> Any:
        return self.generate(input_ids=self.apply_chat_template(messages), sampling_params=sampling_params, **kw)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def abort(self, rid: str) -> None:
        self.loop.inbox.put(("abort", rid))

    # ---- introspection ------------------------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, Any]:
        return self.loop.call(self._cache_stats)

    def _cache_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        cache = self.scheduler.cache
        return {
            "hit_tokens": s.hit_tokens,
            "prompt_tokens": s.prompt_tokens,
            "hit_rate": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "total_pages": self.runner.pool.capacity,
            "free_pages": self.runner.pool.num_free_pages,
            "cached_pages": cache.total_pages,
            "evictable_pages": cache.evictable_pages,
            "page_size": self.runner.pool.page_size,
            "dtype": self.dtype_name,
            "quantization": self.quantization,
            "quantization_reason": self.cpu_choice.reason,
        }

    def metrics(self) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            s = self.scheduler.stats
            return {
                **self._cache_stats(),
                "num_running": len(self.scheduler.running) + len(self.scheduler.finishing),
                "num_waiting": len(self.scheduler.waiting),
                "num_retractions": s.retractions,
                "prompt_tokens_total": s.prompt_tokens,
                "generation_tokens_total": s.generation_tokens,
                "cached_tokens_total": s.hit_tokens,
                "computed_prefill_tokens_total": s.computed_prefill_tokens,
                "failed_requests_total": s.failed,
                "failed_steps_total": s.failed_steps,
            }

        return self.loop.call(snapshot)

    def flush_cache(self) -> bool:
        return self.loop.call(self.scheduler.flush_cache)

    def check_invariants(self) -> None:
        self.loop.call(self.scheduler.check_invariants)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": str(self.model_path),
            "model_name": Path(self.model_path).name,
            "context_length": self.context_length,
            "page_size": self.runner.pool.page_size,
            "vocab_size": self.runner.config.vocab_size,
            "dtype": self.dtype_name,
            "quantization": self.quantization,
            "quantization_reason": self.cpu_choice.reason,
            "attention_backend": self.attention_backend,
            "sampling_defaults": dict(self.sampling_defaults),
        }
