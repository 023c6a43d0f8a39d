"""llama.cpp's quantized KV beside ours (issue 40): the same two measures for `-ctk q8_0 -ctv q8_0` against f16 KV.

- perplexity: llama-perplexity over `--text` (files concatenated as benchmarks/quality.py does) in windows of
  `--ctx` tokens; it scores the second half of each window (every scored token sees at least ctx / 2 before it) and
  needs at least two windows, so `--ctx 4096` over our 4,096-token text plus a third file scores tokens
  2,048 .. 4,095 (the second half of the text ours scores whole) and 6,144 .. 8,191;
- greedy agreement: benchmarks/quality.py's prompts through llama-server (llama-server's own chat template), 64
  greedy tokens each (`ignore_eos`), compared token by token with the f16-KV server's.

Both sides run with flash attention on (`-fa on`), which llama.cpp needs for a quantized V cache, so the KV type is
the only difference. `--threads` defaults to 1: on this shared 2-core machine llama.cpp's 2-thread decode collapsed
to under 1 token/s (each step ends in a barrier that waits out a time slice; benchmarks/llama_threads.py). The model is the default GGUF (Q4_K_M weights); llama.cpp's binaries come from
scripts/install_peers.sh (`$LLAMA_SERVER`, `$LLAMA_PERPLEXITY`, else .peers/bin/).

    .venv/bin/python -m benchmarks.kv_quant_llamacpp --prompts 50 \
        --text tests/data/perplexity_text.txt docs/router.md docs/DESIGN.md
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import httpx

from benchmarks.compare import engines as eng
from benchmarks.compare.__main__ import default_models
from benchmarks.kv_quant import header
from benchmarks.quality import AGREE_TOKENS, PROMPTS, TEXT, agreement_row, agreement_table

KV_TYPES = {"f16": ["-ctk", "f16", "-ctv", "f16", "-fa", "on"], "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]}


def binary(name: str, env_var: str) -> Path:
    """A llama.cpp tool: $env_var, else the one beside llama-server."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    server = eng.llama_server_binary()
    if server is None:
        raise SystemExit("needs llama.cpp's binaries (scripts/install_peers.sh, or $LLAMA_SERVER)")
    return server.parent / name


def perplexity(tool: Path, gguf: Path, text: str, ctx: int, kv: list[str], threads: int) -> float:
    """llama-perplexity's final estimate over `text` in windows of ctx tokens."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        env = dict(os.environ, LD_LIBRARY_PATH=str(tool.parent))
        cmd = [str(tool), "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *kv]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found.group(1))


def greedy(server_bin: Path, gguf: Path, kv: list[str], n: int, threads: int, log_dir: Path) -> list[list[int]]:
    """Token ids of 64 greedy tokens for each of the first n prompts, through one llama-server with KV args kv."""
    port = eng.free_port()
    cmd = [str(server_bin), "-m", str(gguf), "-np", "1", "-c", "4096", "-t", str(threads), "--port", str(port), *kv]
    server = eng.launch("llama-server", cmd, port, threads, log_dir)
    try:
        outs = []
        for prompt in PROMPTS[:n]:
            messages = {"messages": [{"role": "user", "content": prompt}]}
            templated = httpx.post(server.url + "/apply-template", json=messages, timeout=60).raise_for_status()
            body = {
                "prompt": templated.json()["prompt"],
                "n_predict": AGREE_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            r = httpx.post(server.url + "/completion", json=body, timeout=600).raise_for_status()
            outs.append(r.json()["tokens"])
        return outs
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--text", type=Path, nargs="+", default=[TEXT])
    ap.add_argument("--prompts", type=int, default=50, choices=range(1, len(PROMPTS) + 1), metavar="N")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/kv_quant_llamacpp"), help="llama-server's logs")
    a = ap.parse_args()
    header()
    gguf, _ = default_models()
    server_bin = binary("llama-server", "LLAMA_SERVER")
    ppl_bin = binary("llama-perplexity", "LLAMA_PERPLEXITY")
    text = "\n\n".join(p.read_text() for p in a.text)
    rows, reference, ppl_ref = [], None, None
    for name, kv in KV_TYPES.items():
        ppl = perplexity(ppl_bin, gguf, text, a.ctx, kv, a.threads)
        print(f"{name}: perplexity {ppl:.3f}; load {os.getloadavg()[0]:.1f}", flush=True)
        outs = greedy(server_bin, gguf, kv, a.prompts, a.threads, a.log_dir)
        reference, ppl_ref = reference or outs, ppl_ref or ppl
        rows.append(agreement_row(name, ppl, ppl_ref, outs, reference))
        print(f"{name}: greedy done; load {os.getloadavg()[0]:.1f}", flush=True)
    print(agreement_table("llama.cpp KV", f"ctx {a.ctx}", "f16", rows))


if __name__ == "__main__":
    main()
