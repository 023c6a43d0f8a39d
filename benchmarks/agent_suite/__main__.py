"""`python -m benchmarks.agent_suite --python VENV_PY (--base-url URL | --engine radix|llama)`: run the 40 scenarios
against a running OpenAI-compatible server, or start radixserve (the default model) or llama.cpp's llama-server
(the same GGUF, with its Jinja chat template so it parses tool calls) and stop it after. Prints each outcome as it
comes, then the table and the failures; `--out` keeps the outcomes as JSON lines."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.agent_suite.runner import failures, run_suite, save, table
from benchmarks.compare.engines import free_port, launch, llama_server_binary

GGUF = Path.home() / ".cache" / "radixserve" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def engine_command(engine: str, port: int, jobs: int) -> list[str]:
    if engine == "radix":
        return [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--max-total-tokens", "16384"]
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("llama-server not found: set $LLAMA_SERVER or run scripts/install_peers.sh")
    # -c is split across the -np slots: 8192 tokens for each concurrent scenario
    return [str(binary), "-m", str(GGUF), "--jinja", "--port", str(port), "-np", str(jobs), "-c", str(8192 * jobs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--python", required=True, help="interpreter with the agent libraries (scripts/agent_suite_venv.sh)"
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:30000 (/v1 is added)")
    where.add_argument("--engine", choices=("radix", "llama"), help="start this engine on the default model")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one scenario")
    ap.add_argument("--jobs", type=int, default=3, help="scenarios at a time")
    ap.add_argument("--only", nargs="*", help="libraries or library/scenario names to run")
    ap.add_argument("--threads", type=int, default=2, help="threads for a started engine")
    ap.add_argument("--out", type=Path, help="write the outcomes here as JSON lines")
    args = ap.parse_args()
    server = None
    if args.engine:
        port = free_port()
        cmd = engine_command(args.engine, port, args.jobs)
        server = launch(args.engine, cmd, port, args.threads, Path("/tmp/agent_suite_logs"))
        url = server.url
    else:
        url = args.base_url.rstrip("/")
    try:
        outcomes = run_suite(
            args.python, url.removesuffix("/v1") + "/v1", args.timeout, args.jobs, set(args.only or ())
        )
    finally:
        if server is not None:
            server.stop()
    print(table(outcomes))
    print(failures(outcomes))
    if args.out:
        save(outcomes, args.out)


if __name__ == "__main__":
    main()
