"""The `radixserve` command: `serve` (the HTTP server), `chat` (an interactive terminal chat) and `generate` (one completion).

With no --model, each uses the default Qwen2.5-Coder-0.5B-Instruct, assembled and converted once into the cache folder."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, TypeVar

from radixserve import __version__
from radixserve.cli_args import build_parser, engine_kwargs, sampling_params
from radixserve.io import GenerateRequest, OutputMeta
from radixserve.model.resolve import resolve_model
from radixserve.summary import startup_summary

if TYPE_CHECKING:
    from radixserve.engine import Engine

T = TypeVar("T")
EXIT_USAGE = 2


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
    _start_moving_early(args, model)
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
        incremental_streaming_output=args.incremental_streaming_output,
        reasoning_parser=args.reasoning_parser,
        agent_retention=not args.no_agent_retention,
    )
    return 0


def _start_moving_early(args: argparse.Namespace, model: Path) -> None:
    """Where the start will run a GGUF's own blocks (radixserve/model/cpu_select.py: `gguf`, or `auto` on x86 with
    no dtype asked), map them and start moving them onto huge pages now, so that the move runs beside torch's import
    (radixserve/gguf/huge_pages.py). A guess that turns out wrong costs the map's read: the load drops it."""
    from radixserve.gguf import huge_pages
    from radixserve.gguf.convert import converted_source

    blocks = args.quantization == "gguf" or (
        args.quantization == "auto" and args.dtype == "auto" and platform.machine() in ("x86_64", "AMD64")
    )
    source = converted_source(model)
    plain_cpu = args.device == "cpu" and args.tp == 1 and not args.null_model
    if blocks and plain_cpu and source is not None and source.is_file():
        huge_pages.start_early(source)


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
