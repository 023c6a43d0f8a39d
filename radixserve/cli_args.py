"""The command line's options: the parser of `radixserve` and the mapping of parsed flags onto Engine and sampling
arguments. Engine flags are checked against EngineConfig's fields (tests/test_cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from radixserve import __version__


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face folder or .gguf file (default: Qwen2.5-Coder-0.5B-Instruct)"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where the default model and converted GGUFs live (default: $RADIXSERVE_CACHE or ~/.cache/radixserve)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype; 'auto' picks by the CPU: bfloat16 where it has bf16 hardware "
        "(AVX512-BF16, AMX), else float32 (default: %(default)s)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4", "gguf"],
        help="CPU weight format: 'int8' is weight-only int8 per output channel, 'int4' weight-only int4 "
        "in groups of 64 input columns, 'gguf' the GGUF file's own blocks (Q4_0/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K); 'auto' (with --dtype auto) picks by the CPU: int8 plus a bf16 copy "
        "of its codes on AVX512-BF16/AMX, none elsewhere (see /get_model_info's quantization_reason) "
        "(default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N' (default: %(default)s)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel: split every layer over this many processes (GPUs with --device cuda; "
        "torchrun-compatible) (default: %(default)s)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from free memory)"
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="KV pool size as a memory budget in GiB, instead of --max-total-tokens: the tokens it holds follow "
        "from --kv-cache-dtype",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        # radixserve.cache.kv_format.KV_DTYPES, spelled out: this module imports no torch (tests/test_cli.py checks)
        choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3"],
        help="how KV pages are stored: int8 (rows rotated; keys a scale per 16 values, values a scale a row) holds 1.86x "
        "the tokens of bfloat16; "
        "fp8_e4m3 is for FlashInfer on CUDA (default: %(default)s, the model's dtype; bfloat16 where --dtype auto "
        "picks float32 on a CPU without bf16 hardware)",
    )
    p.add_argument("--context-length", type=int, default=None, help="cap the context below the model's own")
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=["torch", "triton", "flashinfer"],
        help="default: flashinfer on CUDA, torch elsewhere",
    )
    p.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="max prompt tokens computed per step (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-merge-tokens",
        type=_merge_tokens,
        default="auto",
        help="a prefill chunk longer than this runs in a step with no other prefill "
        "('auto': 32 on CPU, no limit on CUDA; 'none': no limit)",
    )
    p.add_argument(
        "--schedule-policy",
        default="lpm",
        choices=["lpm", "fcfs"],
        help="queue order: 'lpm' admits the longest cached prefix first, 'fcfs' arrival order (default: %(default)s)",
    )
    p.add_argument(
        "--fair-share",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="admit tenants (API keys) in turn by prefill tokens served, so one tenant's flood cannot "
        "starve another; within a tenant --schedule-policy applies (default: on)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="requests decoding at once; more wait in the queue (default: %(default)s)",
    )
    p.add_argument("--disable-radix-cache", action="store_true", help="compute every prompt from scratch")
    p.add_argument(
        "--disable-partial-page-reuse",
        action="store_true",
        help="compute the tokens of a cached prefix that end part way through a page instead of copying "
        "their KV from the page that holds them",
    )
    p.add_argument(
        "--disable-jump-forward",
        action="store_true",
        help="constrained decoding samples every token, even those the grammar forces",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a request's tokens and logprobs never depend on cache hits, the other requests in a step, the "
        "chunk size or speculation: batch-invariant kernels (CPU, int8 weights; default: on for AVX-512 BF16 CPUs "
        "without AMX, where it measured no slower, off elsewhere; --deterministic refuses other settings)",
    )
    p.add_argument(
        "--null-model",
        action="store_true",
        help="for benchmarks and tests: load no weights; every step returns fixed logits of the model's shape at once, "
        "so the engine's own host cost per step can be measured (answers are meaningless)",
    )
    p.add_argument(
        "--init-new-token-ratio",
        type=float,
        default=0.7,
        help="share of each request's max_new_tokens that admission reserves pages for at first; it decays "
        "while requests stop early and rises after a retraction (default: %(default)s)",
    )
    p.add_argument(
        "--sampling-defaults",
        default="model",
        choices=["model", "none"],
        help="'model': requests that leave temperature, top_p, top_k, min_p or repetition_penalty unset "
        "get the model publisher's values (generation_config.json, or a table for known GGUFs); "
        "'none': the API defaults (temperature 1, no truncation). Default: %(default)s",
    )
    p.add_argument(
        "--speculative",
        default="auto",
        choices=["auto", "off", "ngram"],
        help="speculative decoding with n-gram drafts from the prompt and the radix cache; greedy output "
        "is unchanged, sampled output keeps its distribution; 'auto': on for CPU at batch sizes "
        "where it pays, off on CUDA; 'ngram': always (turns overlap scheduling off) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--speculative-max-tokens",
        type=int,
        default=8,
        help="most draft tokens verified per request and step (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-dir",
        default=None,
        help="keep KV pages evicted from the pool in this directory, and the cache across restarts (default: off)",
    )
    p.add_argument(
        "--kv-cache-disk-gb",
        type=float,
        default=10.0,
        help="size limit of --kv-cache-dir in GB; least recently used pages go past it (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-host-gb",
        type=float,
        default=None,
        help="size of the host-RAM tier between the KV pool and --kv-cache-dir in GB; 0: off (default: on a GPU, "
        "twice the pool but at most a quarter of the available RAM; off on CPU)",
    )
    p.add_argument(
        "--max-pinned-share",
        type=float,
        default=0.5,
        help="share of the KV pool that pinned prefixes (POST /cache/pin) may hold (default: %(default)s)",
    )
    p.add_argument(
        "--max-retained-share",
        type=float,
        default=0.5,
        help="share of the KV pool that retained prefixes (cache_control ttls, prompt_cache_retention, "
        "retention_seconds, agent retention) may hold (default: %(default)s)",
    )
    p.add_argument(
        "--max-retained-share-per-tenant",
        type=float,
        default=0.25,
        help="share of the KV pool that one tenant's retained prefixes may hold (default: %(default)s)",
    )


def _merge_tokens(value: str) -> int | str | None:
    if value in ("auto", "none"):
        return None if value == "none" else value
    return int(value)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float | None) -> None:
    p.add_argument("--max-new-tokens", type=int, default=512, help="most tokens in an answer (default: %(default)s)")
    what = "the model's recommended value (see --sampling-defaults), else 1" if temperature is None else temperature
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default: {what})")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default: the model's)")
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k best tokens, -1 off (default: the model's)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="An LLM serving engine with a radix prefix cache.")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every request but /health; repeat it (or separate "
        "keys with commas) for several keys, each its own cache namespace; a key may be followed "
        "by options, e.g. 'sk-x name=ops role=user' (these keys are admin unless role=user). "
        "Keys on the command line show in the process list: prefer --api-key-file or "
        "$RADIXSERVE_API_KEYS (same format as --api-key)",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="keys, one a line: KEY [name=NAME] [role=admin|user] [max_concurrent=N] [max_queued=N] "
        "[tokens_per_minute=N] ('#' after a blank starts a comment; role user unless it says "
        "admin); reread on SIGHUP",
    )
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests get to finish before they are stopped (default: %(default)s)",
    )
    serve.add_argument("--max-queued-requests", type=int, default=None, help="answer 429 beyond this many waiting")
    serve.add_argument("--served-model-name", default=None, help="the model id the API reports (default: folder name)")
    serve.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="connections and requests handled at once; past it 503 (default: %(default)s)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a new connection gets to send its request headers (default: %(default)s)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds between two pieces of a request body before 408 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body in MiB; past it 413 (default: %(default)s)",
    )
    serve.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data parallel: run this many replicas (ports after --port, cores or GPUs split between "
        "them) behind the cache-aware router on --port (default: %(default)s, no router)",
    )
    from radixserve.router.policy import POLICIES  # no torch

    serve.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=POLICIES,
        help="with --dp: how the router picks a replica (default: %(default)s)",
    )
    serve.add_argument(
        "--otlp-endpoint",
        default=None,
        help="send OpenTelemetry spans of each request (queued, prefill chunks, decode, retractions) "
        "over OTLP/HTTP to this collector URL (default: off)",
    )

    serve.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="a streamed /generate sends only the new text, output_ids and output logprobs in each event "
        "(default: all of them so far, as SGLang's server does)",
    )
    from radixserve.server.reasoning import REASONING_PARSERS  # no torch

    serve.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="split a thinking model's <think> reasoning from its answer (reasoning_content, a reasoning item, a "
        "thinking block): auto where the chat template writes </think>, always for qwen3 and deepseek-r1, never "
        "for none (default: %(default)s)",
    )
    serve.add_argument(
        "--no-agent-retention",
        action="store_true",
        help="do not retain the prefix of a chat turn that ends in tool calls (default: retained for the tool gap "
        "learned per tenant, the 90th percentile within 2-600 s)",
    )

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    _add_engine_args(chat)
    _add_sampling_args(chat, temperature=None)
    chat.add_argument("--system", default=None, help="system prompt")

    gen = sub.add_parser("generate", help="print one completion of PROMPT")
    _add_engine_args(gen)
    _add_sampling_args(gen, temperature=0.0)
    gen.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")

    from radixserve.router.launch import add_route_args  # no torch: `route` stays light

    add_route_args(sub.add_parser("route", help="route requests across several radixserve servers (cache-aware)"))
    return parser


def engine_kwargs(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    """Keyword arguments for Engine(...) from the parsed command line, with the model already resolved."""
    return {
        "model": str(model_path),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": args.device,
        "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens,
        "kv_cache_gb": args.kv_cache_gb,
        "kv_cache_dtype": args.kv_cache_dtype,
        "context_length": args.context_length,
        "attention_backend": args.attention_backend,
        "chunked_prefill_size": args.chunked_prefill_size,
        "prefill_merge_tokens": args.prefill_merge_tokens,
        "schedule_policy": args.schedule_policy,
        "fair_share": args.fair_share,
        "max_running_requests": args.max_running_requests,
        "enable_radix_cache": not args.disable_radix_cache,
        "enable_partial_page_reuse": not args.disable_partial_page_reuse,
        "enable_jump_forward": not args.disable_jump_forward,
        "overlap_schedule": args.overlap_schedule,
        "sampling_defaults": args.sampling_defaults,
        "init_new_token_ratio": args.init_new_token_ratio,
        "speculative": args.speculative,
        "speculative_max_tokens": args.speculative_max_tokens,
        "kv_cache_dir": args.kv_cache_dir,
        "kv_cache_disk_gb": args.kv_cache_disk_gb,
        "kv_cache_host_gb": args.kv_cache_host_gb,
        "max_pinned_share": args.max_pinned_share,
        "max_retained_share": args.max_retained_share,
        "max_retained_share_per_tenant": args.max_retained_share_per_tenant,
        "tp": args.tp,
        "null_model": args.null_model,
        "deterministic": args.deterministic,
    }


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    params = {k: v for k, v in params.items() if v is not None}  # unset: the model's defaults apply
    if args.seed is not None:
        params["seed"] = args.seed
    return params
