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
from typing import Any, Callable, Coroutine, TypeVar

from radixserve import __version__
from radixserve.model.resolve import resolve_model
from radixserve.summary import startup_summary

T = TypeVar("T")
EXIT_USAGE = 2


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--cache-dir", default=None, help="where the default model and converted GGUFs live "
                   "(default: $RADIXSERVE_CACHE or ~/.cache/radixserve)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; 'auto' picks by the CPU: bfloat16 where it has bf16 hardware "
                        "(AVX512-BF16, AMX), else float32 (default: %(default)s)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="CPU weight format: 'int8' is weight-only int8 per output channel, 'int4' weight-only int4 "
                        "in groups of 64 input columns; 'auto' (with --dtype auto) picks by the CPU: int8 plus a bf16 copy "
                        "of its codes on AVX512-BF16/AMX, none elsewhere (see /get_model_info's quantization_reason) "
                        "(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N' (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from free memory)")
    p.add_argument("--context-length", type=int, default=None, help="cap the context below the model's own")
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton", "flashinfer"],
                   help="default: flashinfer on CUDA, torch elsewhere")
    p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)")
    p.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="max prompt tokens computed per step (default: %(default)s)")
    p.add_argument("--prefill-merge-tokens", type=_merge_tokens, default="auto",
                   help="a prefill chunk longer than this runs in a step with no other prefill "
                        "('auto': 32 on CPU, no limit on CUDA; 'none': no limit)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="queue order: 'lpm' admits the longest cached prefix first, 'fcfs' arrival order "
                        "(default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoding at once; more wait in the queue (default: %(default)s)")
    p.add_argument("--disable-radix-cache", action="store_true", help="compute every prompt from scratch")
    p.add_argument("--init-new-token-ratio", type=float, default=0.7,
                   help="share of each request's max_new_tokens that admission reserves pages for at first; it decays "
                        "while requests stop early and rises after a retraction (default: %(default)s)")
    p.add_argument("--sampling-defaults", default="model", choices=["model", "none"],
                   help="'model': requests that leave temperature, top_p, top_k, min_p or repetition_penalty unset "
                        "get the model publisher's values (generation_config.json, or a table for known GGUFs); "
                        "'none': the API defaults (temperature 1, no truncation). Default: %(default)s")


def _merge_tokens(value: str) -> int | str | None:
    if value in ("auto", "none"):
        return None if value == "none" else value
    return int(value)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float | None) -> None:
    p.add_argument("--max-new-tokens", type=int, default=512, help="most tokens in an answer (default: %(default)s)")
    what = "the model's recommended value (see --sampling-defaults), else 1" if temperature is None else temperature
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default: {what})")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default: the model's)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k best tokens, -1 off (default: the model's)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="An LLM serving engine with a radix prefix cache.")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every request")
    serve.add_argument("--max-queued-requests", type=int, default=None, help="answer 429 beyond this many waiting")
    serve.add_argument("--served-model-name", default=None, help="the model id the API reports (default: folder name)")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="connections and requests handled at once; past it 503 (default: %(default)s)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a new connection gets to send its request headers (default: %(default)s)")
    serve.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds between two pieces of a request body before 408 (default: %(default)s)")
    serve.add_argument("--max-body-mb", type=float, default=16.0,
                       help="largest request body in MiB; past it 413 (default: %(default)s)")

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
        "max_running_requests": args.max_running_requests,
        "enable_radix_cache": not args.disable_radix_cache,
        "overlap_schedule": args.overlap_schedule,
        "sampling_defaults": args.sampling_defaults,
        "init_new_token_ratio": args.init_new_token_ratio,
    }


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k}
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
    meta: dict[str, Any]
    elapsed: float

    def stats(self) -> str:
        """One line: tokens, time to first token, decode tokens/s, prompt tokens served from the cache."""
        n = self.meta.get("completion_tokens", 0)
        ttft = self.meta.get("ttft", 0.0)
        decode_s = self.meta.get("e2e_latency", self.elapsed) - ttft
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        prompt, cached = self.meta.get("prompt_tokens", 0), self.meta.get("cached_tokens", 0)
        share = 100.0 * cached / prompt if prompt else 0.0
        return (f"[{n} tokens | ttft {ttft:.2f}s | {rate:.1f} tok/s | "
                f"cached {cached}/{prompt} prompt tokens ({share:.0f}%)]")


async def stream_turn(engine: Any, input_ids: list[int], params: dict[str, Any], write: Callable[[str], Any]) -> Turn:
    """Stream one request's text through `write` as it is generated; returns the whole text and the final meta_info."""
    start = time.perf_counter()
    pieces: list[str] = []
    meta: dict[str, Any] = {}
    stream = engine.async_generate(input_ids=input_ids, sampling_params=params, stream=True)
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            if chunk["text"]:
                write(chunk["text"])
                pieces.append(chunk["text"])
            meta = chunk["meta_info"]
    return Turn("".join(pieces), meta, time.perf_counter() - start)


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _make_engine(args: argparse.Namespace) -> Any:
    from radixserve.engine import Engine  # imported here so that `radixserve --help` and usage errors stay fast

    return Engine(**engine_kwargs(args, resolve_model(args.model, args.cache_dir)))


def cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.server.launch import run_server

    kwargs = engine_kwargs(args, resolve_model(args.model, args.cache_dir))
    run_server(kwargs, args.host, args.port, args.api_key, args.max_queued_requests,
               served_model_name=args.served_model_name, max_connections=args.max_connections,
               header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
               max_body_bytes=int(args.max_body_mb * 1024 * 1024))
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
    print(f"ready: chat with {engine.model_info()['model_name']}. Ctrl-D or 'exit' quits; Ctrl-C stops an answer.",
          file=sys.stderr)
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
