"""Our perplexity beside llama.cpp's `llama-perplexity` on the same GGUF, scored by its protocol (issue 38).

llama-perplexity tokenizes the whole file (one trailing newline dropped, BOS only where the GGUF's
`tokenizer.ggml.add_bos_token` says so), cuts the tokens into `n_chunk = len // ctx` windows of `ctx` tokens that do
not overlap (the tail is dropped), evaluates each window from an empty cache (its first token replaced by BOS when the
model adds one) and scores the window's second half: logits at positions ctx/2 .. ctx-2 predict the tokens at
ctx/2+1 .. ctx-1, so ctx/2 - 1 tokens a window. It prints the running totals; `--ppl-output-type 1` gives the running
mean negative log-likelihood to six decimals, from which each window's own value follows.

This module runs llama-perplexity (`--kl-divergence-base` saves the token ids it scored and every scored row's
log-probabilities, 16-bit coded; `--llama-args` adds runs with other settings of its own as columns), checks our
tokenizer gives the same ids, then scores llama.cpp's ids through each of our configs with one request per window
(`logprob_start_len=0`) and prints, per window and overall, both perplexities, the gap, its standard error from the
paired per-token differences, and per token the mean and largest |our log-prob - llama.cpp's| (theirs decoded from
the file: within ~1.2e-4 of the float they computed; a token whose logit is more than 16 below its row's largest is
stored as that floor, so it is left out of the per-token columns, not of the perplexities). A config is
`dtype:quantization`; `float32:none` is the same blocks dequantized to float32 (gguf-py's numbers) with float32
activations: the reference for what both engines round.

    LD_LIBRARY_PATH=.peers/bin .venv/bin/python -m benchmarks.llama_perplexity --ctx 1024 \
        --configs bfloat16:gguf float32:gguf float32:none
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.quant_engine import cpu_flags  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.model.resolve import assemble_default_gguf, default_cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity_text.txt"
PEERS = ROOT / ".peers" / "bin"


@dataclass
class LlamaRun:
    ctx: int
    tokens: np.ndarray  # int32 [n_chunk * ctx]: the ids it scored
    window_nll: list[float]  # each window's summed negative log-likelihood
    logprobs: np.ndarray  # float64 [n_chunk, ctx/2 - 1]: each scored token's log-probability, decoded
    final_line: str


def run_llama(binary: Path, gguf: Path, text: Path, ctx: int, threads: int, base: Path, extra: list[str]) -> LlamaRun:
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *extra]
    cmd += ["--ppl-output-type", "1", "--kl-divergence-base", str(base)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    # Output type 1 prints per window "start  running-ppl  running-mean-nll  its-stderr".
    means = [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s*$", done.stdout, re.M)]
    per = ctx - ctx // 2 - 1
    window_nll = [means[0] * per] + [(means[i] * (i + 1) - means[i - 1] * i) * per for i in range(1, len(means))]
    final = next((ln.split("I ", 1)[-1] for ln in done.stderr.splitlines() if "Final estimate" in ln), "")
    tokens, logprobs = read_base(base, per)
    return LlamaRun(ctx, tokens, window_nll, logprobs, final)


def read_base(path: Path, per: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids and the scored tokens' log-probs from a `--kl-divergence-base` file (layout: perplexity.cpp)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(raw[:8]) != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity logits file")
    ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
    tokens = np.frombuffer(raw[20 : 20 + 4 * n_chunk * ctx], dtype=np.int32).copy()
    nv = 2 * ((n_vocab + 1) // 2) + 4  # per row: float scale, float min log-prob, then one uint16 per vocab entry
    rows = np.frombuffer(raw[20 + 4 * n_chunk * ctx :], dtype=np.uint16).reshape(n_chunk, per, nv)
    first = ctx // 2
    lp = np.empty((n_chunk, per))
    for c in range(n_chunk):
        head = rows[c, :, :4].copy().view(np.float32)  # [per, 2]: scale, min log-prob
        targets = tokens[c * ctx + first + 1 : (c + 1) * ctx]
        codes = rows[c, np.arange(per), 4 + targets].astype(np.float64)
        # Code 0: a logit more than 16 below the row's largest, stored as that floor: its value is unknown (NaN).
        lp[c] = np.where(codes > 0, head[:, 1] + head[:, 0].astype(np.float64) * codes, np.nan)
    return tokens, lp


def score_windows(eng: Engine, run: LlamaRun) -> np.ndarray:
    """Our log-probs `[n_chunk, ctx/2 - 1]` of the tokens llama.cpp scored, each window a fresh request."""
    ctx, first = run.ctx, run.ctx // 2
    out = []
    for c in range(len(run.tokens) // ctx):
        ids = run.tokens[c * ctx : (c + 1) * ctx].tolist()
        res = eng.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
        lps = res["meta_info"]["input_token_logprobs"]  # entry j: log p(ids[j] | ids[:j]); entry 0 has none
        out.append([lps[j][0] for j in range(first + 1, ctx)])
    return np.asarray(out, dtype=np.float64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["bfloat16:gguf", "float32:gguf", "float32:none"])
    ap.add_argument("--text", type=Path, nargs="+", default=[TEXT], help="several: joined by a blank line")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a GGUF (default: the default model's)")
    ap.add_argument("--llama", type=Path, default=PEERS / "llama-perplexity")
    # Its own rounding choices as more columns, e.g. "-ctk f32 -ctv f32 -fa off" (its default KV cache is float16).
    ap.add_argument("--llama-args", nargs="*", default=[], help="extra runs of it, each with these arguments")
    a = ap.parse_args()
    gguf = a.model or assemble_default_gguf(default_cache_dir())
    print(cpu_flags(), f"| load average {os.getloadavg()[0]:.2f}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text("\n\n".join(p.read_text() for p in a.text))
        for extra in ["", *a.llama_args]:
            t = time.perf_counter()
            runs[extra] = run_llama(a.llama, gguf, text, a.ctx, a.threads, Path(tmp) / "base.bin", extra.split())
            print(f"llama-perplexity {extra}: {time.perf_counter() - t:.0f} s; {runs[extra].final_line}", flush=True)
        text = text.read_text()
    run = runs[""]
    per = a.ctx - a.ctx // 2 - 1
    n_chunk = len(run.window_nll)
    cols = {f"llama.cpp {k}".strip(): (np.asarray(r.window_nll), r.logprobs) for k, r in runs.items()}
    for conf in a.configs:
        dtype, quant = conf.split(":")
        t = time.perf_counter()
        with Engine(model=str(gguf), dtype=dtype, quantization=quant, max_total_tokens=a.ctx + 512) as eng:
            ids = eng.tokenizer.encode(text.removesuffix("\n"), add_special_tokens=True)[: n_chunk * a.ctx]
            same = sum(x == y for x, y in zip(ids, run.tokens.tolist()))
            print(f"{conf}: our tokenizer gives {same}/{len(run.tokens)} of llama.cpp's ids", flush=True)
            lp = score_windows(eng, run)
        cols[conf] = (-lp.sum(axis=1), lp)
        print(f"{conf}: {time.perf_counter() - t:.0f} s", flush=True)
    print(f"\nctx {a.ctx}: {n_chunk} windows, {per} tokens scored each (second half); perplexity per window")
    print("| window | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    rows = [f"{c + 1}" for c in range(n_chunk)] + ["all"]
    for r, name in enumerate(rows):
        vals = [(nll[r] / per if r < n_chunk else nll.sum() / (per * n_chunk)) for nll, _ in cols.values()]
        print(f"| {name} | " + " | ".join(f"{math.exp(v):.4f}" for v in vals) + " |")
    llama_ppl = math.exp(np.sum(run.window_nll) / (per * n_chunk))
    # The gap's noise: per token d = our log-prob - llama.cpp's; the log of the perplexity ratio is -mean(d), whose
    # standard error sd(d)/sqrt(n) is what the tokens' rounding differences alone would move it by.
    print(
        "\n| config | perplexity | vs llama.cpp | standard error of the gap | mean abs d log-prob per token | largest |"
    )
    print("|---|---|---|---|---|---|")
    for conf, (nll, lp) in list(cols.items())[1:]:
        ppl = math.exp(nll.sum() / (per * n_chunk))
        d = lp - run.logprobs
        d = d[~np.isnan(d)]  # tokens llama.cpp's file codes below its floor (see read_base) are left out
        se = 100 * d.std(ddof=1) / math.sqrt(d.size)
        print(
            f"| {conf} | {ppl:.4f} | {100 * (ppl / llama_ppl - 1):+.3f}% | {se:.3f}% | {np.abs(d).mean():.4f} "
            f"| {np.abs(d).max():.3f} |"
        )


if __name__ == "__main__":
    main()
