"""The `radixserve` command: `serve` (the HTTP server), `chat` (an interactive terminal chat) and `generate` (one completion).

With no --model, each uses the default Qwen2.5-Coder-0.5B-Instruct, assembled and converted once into the cache folder."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, TypeVar

from radixserve import __version__
from radixserve.io import GenerateRequest, OutputMeta
from radixserve.model.resolve import resolve_model
from radixserve.summary import startup_summary

if TYPE_CHECKING:
    from radixserve.engine import Engine

T = TypeVar("T")
EXIT_USAGE = 2


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
        choices=["auto", "none", "int8", "int4"],
        help="CPU weight format: 'int8' is weight-only int8 per output channel, 'int4' weight-only int4 "
        "in groups of 64 input columns; 'auto' (with --dtype auto) picks by the CPU: int8 plus a bf16 copy "
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
        "tp": args.tp,
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


class _LoopRunner:
    """One event loop kept across calls, so sync code can consume the engine's async streams turn after turn."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        except KeyboardInterrupt:
            task.cancel()  # leaving the stream early aborts the request and frees its pages
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(task)
            raise

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@dataclass
class Turn:
    """The outcome of one streamed request."""

    text: str
    meta: OutputMeta | None  # of the last chunk; None if none came
    elapsed: float

    def stats(self) -> str:
        """One line: tokens, time to first token, decode tokens/s, prompt tokens served from the cache."""
        m = self.meta
        n = m.completion_tokens if m else 0
        ttft = (m.ttft if m else None) or 0.0
        decode_s = (m.e2e_latency if m else self.elapsed) - ttft
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        prompt, cached = (m.prompt_tokens, m.cached_tokens) if m else (0, 0)
        share = 100.0 * cached / prompt if prompt else 0.0
        return (
            f"[{n} tokens | ttft {ttft:.2f}s | {rate:.1f} tok/s | "
            f"cached {cached}/{prompt} prompt tokens ({share:.0f}%)]"
        )


async def stream_turn(
    engine: Engine, input_ids: list[int], params: dict[str, Any], write: Callable[[str], Any]
) -> Turn:
    """Stream one request's text through `write` as it is generated; returns the whole text and the final meta_info."""
    start = time.perf_counter()
    pieces: list[str] = []
    meta = None
    stream = engine.stream(GenerateRequest(input_ids=input_ids, sampling_params=params))
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for chunk in stream:
            if chunk.text:
                write(chunk.text)
                pieces.append(chunk.text)
            meta = chunk.meta_info
    return Turn("".join(pieces), meta, time.perf_counter() - start)


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _make_engine(args: argparse.Namespace) -> Any:
    from radixserve.engine import Engine  # imported here so that `radixserve --help` and usage errors stay fast

    return Engine(**engine_kwargs(args, resolve_model(args.model, args.cache_dir)))


def cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.server.launch import run_server
    from radixserve.server.tenants import KeySources

    keys = KeySources.from_environment(args.api_key, args.api_key_file)
    if keys.configured:
        keys.load()  # a bad or empty key stops the start here, before the model loads
    if args.shutdown_grace_seconds < 0:
        raise ValueError(f"--shutdown-grace-seconds must be >= 0, got {args.shutdown_grace_seconds}")
    model = resolve_model(args.model, args.cache_dir)
    if args.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {args.dp}")
    if args.dp > 1:
        from radixserve.router.replicas import run_replicas

        return run_replicas(args, args.argv, model)
    kwargs = engine_kwargs(args, model)
    run_server(
        kwargs,
        args.host,
        args.port,
        keys if keys.configured else None,
        args.max_queued_requests,
        served_model_name=args.served_model_name,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        grace_period_s=args.shutdown_grace_seconds,
        otlp_endpoint=args.otlp_endpoint,
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = _make_engine(args)
    runner = _LoopRunner()
    try:
        if args.chat:
            ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            ids = engine.encode(prompt)
        turn = runner.run(stream_turn(engine, ids, sampling_params(args), _write_stdout))
        _write_stdout("\n")
        print(turn.stats(), file=sys.stderr)
    finally:
        runner.close()
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    engine = _make_engine(args)
    runner = _LoopRunner()
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling_params(args)
    print(f"radixserve {__version__}\n{startup_summary(engine)}", file=sys.stderr)
    print(
        f"ready: chat with {engine.model_info()['model_name']}. Ctrl-D or 'exit' quits; Ctrl-C stops an answer.",
        file=sys.stderr,
    )
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                break
            except KeyboardInterrupt:  # at the prompt there is no answer to stop: say how to quit instead
                print("\n(Ctrl-D or 'exit' quits)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            if line.strip() in ("exit", "quit", "/exit", "/quit"):
                break
            messages.append({"role": "user", "content": line})
            try:
                ids = engine.apply_chat_template(messages)
                turn = runner.run(stream_turn(engine, ids, params, _write_stdout))
            except KeyboardInterrupt:
                print("\n[stopped]", file=sys.stderr)
                messages.pop()  # the unfinished exchange is left out of the conversation
                continue
            except ValueError as e:  # e.g. the conversation outgrew the context
                print(f"error: {e}", file=sys.stderr)
                messages.pop()
                continue
            _write_stdout("\n")
            print(turn.stats(), file=sys.stderr)
            messages.append({"role": "assistant", "content": turn.text})
    finally:
        runner.close()
        engine.shutdown()
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    from radixserve.router.launch import run_router

    run_router(args)
    return 0


COMMANDS = {"serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate, "route": cmd_route}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixserve` command; returns the exit code (2 for a bad model path or option)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --dp` starts replicas with the same options
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # a missing or broken model path, a bad option: one line, no traceback
        print(f"radixserve: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
