"""The Engine API: submit requests from any thread or event loop; one background thread runs the scheduler loop."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixserve.errors import ParamError
from radixserve.model.cpu_select import choose
from radixserve.model.deterministic import on_by_default, refusal
from radixserve.model.gguf_model import types_without_kernel
from radixserve.gguf.convert import converted_source
from radixserve.host_memory import release_freed_heap
from radixserve.model.resolve import resolve_model
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.cache.kv_format import resolve_kv_dtype
from radixserve.engine_cache import CacheSurface, Checkpointer, attach_tier, close_tier
from radixserve.engine_config import EngineConfig
from radixserve.engine_loop import EngineLoop
from radixserve.engine_requests import RequestPath
from radixserve.engine_stats import EngineStats
from radixserve.inputs import RequestBuilder, RequestSpec
from radixserve.io import GenerateOutput, GenerateRequest, StreamChunk
from radixserve.model.sampling_defaults import load_sampling_defaults
from radixserve.model.runner import ModelRunner, default_attention_backend
from radixserve.output_stage import OutputStage
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.speculative.mode import choose_speculative
from radixserve.timeline import Tracker
from radixserve.tokenizer import Tokenizer
from radixserve.tp_worker import start_tensor_parallel, worker_settings

if TYPE_CHECKING:
    from radixserve.distributed import TPGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured on the default model (2 AVX-512 cores, benchmarks/prefill_step_cost.py): a step costs ~59 ms plus ~2.2 ms
# per prefill token, so merging prefills pays only below ~27 tokens each; 32 leans a little toward throughput.
_CPU_PREFILL_MERGE_TOKENS = 32


async def _as_dicts(outputs: Awaitable[list[GenerateOutput]], single: bool) -> dict[str, Any] | list[dict[str, Any]]:
    dicts = [o.to_dict() for o in await outputs]
    return dicts[0] if single else dicts


async def _dicts(chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for chunk in chunks:
            yield chunk.to_dict()
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # an early exit aborts the request


def _stop(loop: EngineLoop, outputs: OutputStage, scheduler: Scheduler, tp: TPGroup | None) -> None:
    loop.stop()
    outputs.stop()  # after the loop: the final outputs of what it aborted still go out
    close_tier(scheduler)
    if tp is not None:
        tp.close()


class Engine(CacheSurface, EngineStats, RequestPath):
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
        # Quantized linears do not carry tensor parallelism's row-parallel sum yet: with tp > 1, auto runs dense.
        quantization = "none" if c.tp > 1 and c.quantization == "auto" else c.quantization
        self.model_path = resolve_model(None if c.model is None else str(c.model))
        self.cpu_choice = choose(
            c.dtype, quantization, torch.device(c.device).type, self._runs_gguf_blocks(c.dtype, quantization)
        )
        dtype, self.quantization = self.cpu_choice.dtype, self.cpu_choice.quantization
        self.dtype_name = dtype
        self.device = torch.device(c.device)
        if self.device.type == "cuda" and self.device.index is None:  # pin it: each thread binds this same device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.attention_backend = c.attention_backend or default_attention_backend(self.device, _DTYPES[dtype])
        self.kv_cache_dtype = self.cpu_choice.kv_pages(c.kv_cache_dtype)  # "auto" resolved by the CPU's kind
        kv_pages = resolve_kv_dtype(self.kv_cache_dtype, _DTYPES[dtype]).name
        why_not = refusal(self.device.type, self.attention_backend, self.quantization, c.tp, kv_pages)
        if c.deterministic and why_not is not None:
            raise ParamError("deterministic", why_not)
        # Unset: on where it can run and was measured to cost nothing (radixserve/model/deterministic.py).
        auto = why_not is None and on_by_default(self.device.type)
        self.deterministic = auto if c.deterministic is None else c.deterministic
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        # Applied to what a request leaves unset (see radixserve/model/sampling_defaults.py).
        self.sampling_defaults = load_sampling_defaults(self.model_path) if c.sampling_defaults == "model" else {}
        settings = worker_settings(
            str(self.model_path),
            dtype,
            str(self.device),
            c.page_size,
            c.max_total_tokens,
            self.attention_backend,
            c.max_running_requests,
            c.context_length,
            self.quantization,
            self.kv_cache_dtype,
            c.kv_cache_bytes,
        )
        self.tp = start_tensor_parallel(c.tp, settings)  # tp > 1: workers start (under torchrun ranks > 0 serve, exit)
        self.device = self.tp.device if self.tp is not None else self.device  # under torchrun: LOCAL_RANK's GPU
        try:
            self._build(c, dtype)
        except BaseException:
            if self.tp is not None:  # the workers may be anywhere in their start-up: end them, do not talk to them
                self.tp.close(kill=True)
            raise

    def _runs_gguf_blocks(self, dtype: str, quantization: str) -> bool:
        """Whether the weights are a GGUF file whose every matrix has a block kernel: then "auto" may run them as
        stored (cpu_select.auto_weight_format); a file with other types (Q3_K, F16 matrices, ...) is re-quantized."""
        source = converted_source(self.model_path)
        if source is None or (dtype, quantization) != ("auto", "auto"):
            return source is not None
        missing = types_without_kernel(source)
        if missing:
            log.info("%s has block types without a kernel (%s): auto re-quantizes it", source.name, ", ".join(missing))
        return not missing

    def _build(self, c: EngineConfig, dtype: str) -> None:
        """The runner (weights and KV pool), the scheduler and the loop."""
        self.runner = ModelRunner(
            self.model_path,
            _DTYPES[dtype],
            self.device,
            c.page_size,
            c.max_total_tokens,
            self.attention_backend,
            c.max_running_requests,
            c.context_length,
            quantization=self.cpu_choice.quantization,
            tp=self.tp,
            null_model=c.null_model,
            deterministic=self.deterministic,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_bytes=c.kv_cache_bytes,
        )
        cfg = self.runner.config
        # Positions past max_position_embeddings have no rotary table; attention is full (no sliding window is
        # implemented), so a windowed model is exact only up to its window.
        limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        if c.context_length is not None and c.context_length > limit:
            raise ParamError(
                "context_length", f"context_length {c.context_length} exceeds what the model supports ({limit})"
            )
        self.context_length = c.context_length or limit
        self.max_queued_requests = c.max_queued_requests
        pool = self.runner.pool
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, eos)
        self.inputs = RequestBuilder(
            self.tokenizer,
            cfg.vocab_size,
            self.context_length,
            pool.capacity * pool.page_size,
            self.sampling_defaults,
            self.grammars,
            eos,
        )
        self.encode_prompts = self.inputs.encode_prompts  # the server tokenizes prompts in a thread with it
        self.compile_grammars = self.inputs.compile_grammars  # compiles grammars, waiting for them
        self.grammar_jobs = self.inputs.grammar_jobs  # submits them to the compiler's thread (the server awaits them)
        # Speculation runs with overlap off (radixserve/speculative/mode.py); `auto` turns it on where it pays.
        self.speculative = choose_speculative(c.speculative, self.device.type, c.overlap_schedule)
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
            fair_share=c.fair_share,
            enable_partial_page_reuse=c.enable_partial_page_reuse,
            init_new_token_ratio=c.init_new_token_ratio,
            prefill_merge_tokens=merge,
            speculative_max_tokens=c.speculative_max_tokens if self.speculative.enabled else 0,
            speculative_max_batch=self.speculative.max_batch,
            speculative_measured=self.speculative.measured,
            vocab_size=cfg.vocab_size,
            max_pinned_share=c.max_pinned_share,
            max_retained_share=c.max_retained_share,
            max_retained_share_per_tenant=c.max_retained_share_per_tenant,
            enable_jump_forward=c.enable_jump_forward,
        )
        self.scheduler = Scheduler(sched_cfg, self.runner.pool, eos)
        # The disk tier under the radix tree (--kv-cache-dir): evicted pages spill there and survive restarts.
        self.tier = attach_tier(c, self.scheduler, self.runner, self.model_path, self.quantization)

        # Overlap: a worker thread runs step N (on a GPU it only launches kernels) while the loop processes step N-1
        # and schedules N+1. On a CPU both would share the same cores, so it is off there by default.
        self.overlap_schedule = self.speculative.overlap
        self._inflight = 0  # requests submitted and not finished (the queue limit counts those not yet running)
        self._inflight_lock = threading.Lock()
        self.tracker = Tracker()  # request timelines (radixserve/timeline.py), read by the dashboard and exporters
        inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        # Detokenizing, stop strings and results on a thread of their own (radixserve/output_stage.py)
        self.outputs = OutputStage(self.tokenizer, inbox)
        self.loop = EngineLoop(
            self.scheduler,
            self.runner,
            self.device,
            self.overlap_schedule,
            inbox,
            self.outputs.put,
            self.tracker,
            idle=Checkpointer(self.scheduler),
        )
        # An engine never shut down still stops its loop (and its tensor-parallel workers) at interpreter exit, before
        # torch's threads are torn down under it (that aborts the process), and persists its cache tree to the disk
        # tier.
        self._finalizer = weakref.finalize(self, _stop, self.loop, self.outputs, self.scheduler, self.tp)
        release_freed_heap()  # what loading freed (the tokenizer's parse above all) leaves the RSS

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the loop (and the tensor-parallel workers); requests still queued or running end with finish_reason
        abort; the cache tree is written to the disk tier (--kv-cache-dir) for the next start."""
        self._finalizer()

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine loop, if it stopped on an error."""
        return self.loop.error

    # ---- typed API: GenerateRequest in, GenerateOutput / StreamChunk out -----------------------------------------
    async def run(self, request: GenerateRequest) -> list[GenerateOutput]:
        """Run a request to the end: one output per prompt and sample (prompt-major). Bad input raises ParamError
        before anything is queued; cancelling aborts what was queued."""
        specs, _ = self._specs(request)
        return await self._collect(specs)

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """A single prompt with n == 1, chunk by chunk (bad input raises here, at the call)."""
        return self._stream(self._single_spec(request))

    async def run_all(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """Several requests run as one batch, queued together (one call of `run` with all their prompts): one list
        of outputs per request. Bad input in any raises before anything is queued."""
        groups = [self._specs(r)[0] for r in requests]
        outs = await self._collect([s for group in groups for s in group])
        bounds = itertools.accumulate((sum(s.params.n for s in group) for group in groups), initial=0)
        return [outs[a:b] for a, b in itertools.pairwise(bounds)]

    def stream_all(self, requests: list[GenerateRequest]) -> list[AsyncIterator[StreamChunk]]:
        """Streams of several requests (each a single prompt with n == 1), queued now and together, so that they reach
        the scheduler in one step as a batch of `run` does; bad input raises before any is queued. Read each stream
        to its end, or `abort` its rid."""
        return self._stream_all([self._single_spec(r) for r in requests])

    def _single_spec(self, r: GenerateRequest) -> RequestSpec:
        specs, _ = self._specs(r)
        if len(specs) != 1 or specs[0].params.n != 1:
            raise ParamError("stream", "stream=True takes a single prompt with n == 1")
        return specs[0]

    def _specs(self, r: GenerateRequest) -> tuple[list[RequestSpec], bool]:
        return self.inputs.specs(
            r.prompt,
            r.sampling_params,
            r.input_ids,
            r.return_logprob,
            r.logprob_start_len,
            r.top_logprobs_num,
            r.cache_salt,
            r.rid,
            r.priority,
            r.timeout,
            r.tenant,
            r.token_ids_logprob,
            r.retention_seconds,
            r.retention_priority,
        )

    # ---- dict API (the documented contract: {"text", "output_ids", "meta_info"}, built from the typed outputs) ----
    def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        """stream=False: an awaitable of a dict (list for list input or n > 1); stream=True: an async iterator of chunks.

        The other arguments are GenerateRequest's, in its order: prompt, sampling_params, input_ids, return_logprob,
        logprob_start_len, top_logprobs_num, cache_salt, rid, priority (higher is admitted first and may retract
        lower-priority running requests), timeout (seconds after which the request is aborted, finish_reason abort,
        message "timeout", and its pages freed), tenant (the group whose fair share of prefill it uses; default:
        cache_salt), token_ids_logprob (with return_logprob: the logprobs of these ids at each position),
        retention_seconds and retention_priority (keep the finished request's cached prefix ahead of LRU eviction
        that long after its last hit; radixserve/cache/retention.py). They are
        validated here, before anything is queued, so bad input raises ValueError at the call."""
        request = GenerateRequest(*args, **kwargs)
        if stream:
            return _dicts(self.stream(request))
        specs, single = self._specs(request)
        return _as_dicts(self._collect(specs), single)

    def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generate (async_generate's arguments, without stream): a dict for one prompt (n == 1), else a
        list (prompt-major, then sample)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Engine.generate blocks; inside an event loop use `await engine.async_generate(...)`")
        specs, single = self._specs(GenerateRequest(*args, **kwargs))
        return asyncio.run(_as_dicts(self._collect(specs), single))

    def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, **kw: Any) -> Any:
        return self.generate(input_ids=self.apply_chat_template(messages), sampling_params=sampling_params, **kw)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)


def _with_request_signature(method: Any, *extra: inspect.Parameter) -> None:
    """Show GenerateRequest's parameters (and `extra`) in the signature of a method that forwards *args/**kwargs to
    it, so help() and editors list them; the fields are spelled once, in radixserve/io.py."""
    own = inspect.signature(method)
    fields = list(inspect.signature(GenerateRequest).parameters.values())
    method.__signature__ = own.replace(parameters=[own.parameters["self"], *fields, *extra])


_with_request_signature(Engine.generate)
_with_request_signature(
    Engine.async_generate, inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")
)
