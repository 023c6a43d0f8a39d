"""CPU speed of the default model (Qwen2.5-Coder-0.5B-Instruct, bf16) beside transformers and the machine's floors.

In one run, interleaved and repeated (this machine is shared; read the ratios, medians of the repeats):
- decode tokens/s at batch 1 and at batch 8 (8 distinct 64-token prompts, greedy, ignore_eos);
- prefill tokens/s and time to first token of a 1024-token prompt;
each for radixserve's Engine and for transformers' AutoModelForCausalLM on the same weights (our converted folder
of the GGUF) in bf16 with its own KV cache, plus:
- the memory-bandwidth floor of decode: bytes of weights read per step / bandwidth of a 1 GiB tensor copy
  (read + write bytes over time), measured in the same run; batch 8 reads the same weights once per step;
- the compute floor of prefill: its matmul FLOPs / the FLOP/s of a large bf16 matmul measured in the same run;
- engine start-up from the assembled cache: `Engine(dtype="bfloat16")` in this process, and a fresh interpreter
  that imports radixserve, builds the engine and generates one token.
Prints a markdown table and appends it to benchmarks/RESULTS.md (unless --no-record).

    .venv/bin/python -m benchmarks.cpu_speed [--repeats 3] [--new-tokens 32] [--no-record]
"""

from __future__ import annotations

import os

# What radixserve/__init__.py sets, here before this script imports torch (libgomp reads it when torch loads):
# idle OpenMP threads sleep instead of spinning, which on a busy machine made 2 threads ~10x slower. transformers
# runs in this process, so it gets the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.model.resolve import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PREFILL_LEN = 1024
DECODE_PROMPT_LEN = 64
BATCH = 8


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else "n/a"


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s moved by a large tensor copy, counting the read and the write (best of `repeats`)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def matmul_flops(repeats: int = 5) -> float:
    """FLOP/s of a bf16 [1024 x 896] @ [896 x 4864] matmul, the shape of prefill's widest projections."""
    a = torch.randn(PREFILL_LEN, 896, dtype=torch.bfloat16)
    b = torch.randn(896, 4864, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best


def weight_bytes_per_decode_step(model_dir: Path) -> tuple[int, int]:
    """(bytes of bf16 weights one decode step reads, matmul parameters per token): every matrix once, except
    the embedding table, of which a step reads only its tokens' rows (unless it doubles as the LM head)."""
    from radixserve.model.loader import read_config

    c = read_config(model_dir)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + the LM head
    return 2 * matmul_params, matmul_params


def source_tokens(tokenize: Callable[[str], list[int]], n: int) -> list[int]:
    """`n` tokens of real code (this repository's Python sources), so the prompts look like a coder's."""
    text = "".join(p.read_text() for p in sorted((ROOT / "radixserve").rglob("*.py")))
    ids = tokenize(text)
    if len(ids) < n:
        raise RuntimeError(f"only {len(ids)} source tokens, need {n}")
    return ids[:n]


class Ours:
    """radixserve's Engine: greedy generate through the scheduler, timings from meta_info."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Decode tokens/s over the batch: tokens after the first / time after the last first token."""
        self.eng.flush_cache()
        outs = self.eng.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        )
        tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
        first = max(o["meta_info"]["ttft"] for o in outs)
        last = max(o["meta_info"]["e2e_latency"] for o in outs)
        return tokens / (last - first)

    def prefill(self, prompt: list[int]) -> float:
        """Time to first token (s) of one prompt, computed from scratch."""
        self.eng.flush_cache()
        out = self.eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
        return out["meta_info"]["ttft"]


class Theirs:
    """transformers on the same weights in bf16: a prefill forward, then one forward per token with its KV cache."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    @torch.inference_mode()
    def _run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        from transformers import DynamicCache

        cache = DynamicCache()
        t0 = time.perf_counter()
        out = self.model(torch.tensor(prompts), past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = self.model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return t1 - t0, time.perf_counter() - t1

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        _, decode_s = self._run(prompts, new_tokens)
        return len(prompts) * (new_tokens - 1) / decode_s

    def prefill(self, prompt: list[int]) -> float:
        prefill_s, _ = self._run([prompt], 1)
        return prefill_s


def startup_fresh_process(model_dir: Path) -> float:
    """Seconds for a new interpreter to import radixserve, build the default engine and generate one token."""
    code = (
        "import time; t = time.perf_counter()\n"
        "from radixserve import Engine\n"
        "eng = Engine(dtype='bfloat16')\n"
        "eng.generate(input_ids=[1, 2, 3], sampling_params={'max_new_tokens': 1})\n"
        "print(time.perf_counter() - t); eng.shutdown()\n"
    )
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "radixserve", "benchmarks/cpu_speed.py")
    return git("rev-parse", "--short", "HEAD") + (" (+ uncommitted changes)" if dirty else "")


def machine() -> str:
    name = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{name}, {os.cpu_count()} cores{' with AVX-512 BF16' if 'avx512_bf16' in flags else ''}, {mem:.0f} GiB, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every measurement")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per decode request")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    load_before = load_average()
    started = datetime.datetime.now()

    model_dir = resolve_model(None)
    t = time.perf_counter()
    eng = Engine(dtype="bfloat16")
    engine_build_s = time.perf_counter() - t
    ours = Ours(eng)
    theirs = Theirs(model_dir)

    stream = source_tokens(eng.encode, PREFILL_LEN + BATCH * DECODE_PROMPT_LEN)
    long_prompt = stream[:PREFILL_LEN]
    prompts = [
        stream[PREFILL_LEN + i * DECODE_PROMPT_LEN : PREFILL_LEN + (i + 1) * DECODE_PROMPT_LEN] for i in range(BATCH)
    ]

    cases: dict[str, Callable[[Any], float]] = {
        "decode1": lambda m: m.decode(prompts[:1], args.new_tokens),
        "decode8": lambda m: m.decode(prompts, args.new_tokens),
        "ttft1k": lambda m: m.prefill(long_prompt),
    }
    engines = {"ours": ours, "theirs": theirs}
    for m in engines.values():  # warm-up: oneDNN primitives and allocator pools for every shape
        for case in cases.values():
            case(m)
    res: dict[tuple[str, str], list[float]] = {(e, c): [] for e in engines for c in cases}
    bandwidth: list[float] = []
    flops: list[float] = []
    for rep in range(args.repeats):
        bandwidth.append(copy_bandwidth())
        flops.append(matmul_flops())
        for c, case in cases.items():
            for e, m in engines.items():
                res[(e, c)].append(case(m))
        print(
            f"repeat {rep + 1}/{args.repeats}: "
            + ", ".join(f"{e} {c} {res[(e, c)][-1]:.3g}" for c in cases for e in engines),
            flush=True,
        )
    del theirs
    startup_s = startup_fresh_process(model_dir)
    eng.shutdown()

    step_bytes, params = weight_bytes_per_decode_step(model_dir)
    bw, fl = med(bandwidth), med(flops)
    floor_step_s = step_bytes / bw
    prefill_flop = 2 * params * PREFILL_LEN  # the projections; attention adds a few percent at 1k
    ttft_ours, ttft_theirs = med(res[("ours", "ttft1k")]), med(res[("theirs", "ttft1k")])
    rows = [
        (
            "decode, batch 1 (tokens/s)",
            med(res[("ours", "decode1")]),
            med(res[("theirs", "decode1")]),
            1 / floor_step_s,
        ),
        (
            "decode, batch 8 (tokens/s, all requests)",
            med(res[("ours", "decode8")]),
            med(res[("theirs", "decode8")]),
            BATCH / floor_step_s,
        ),
        (
            f"prefill, {PREFILL_LEN}-token prompt (tokens/s)",
            PREFILL_LEN / ttft_ours,
            PREFILL_LEN / ttft_theirs,
            PREFILL_LEN / (prefill_flop / fl),
        ),
    ]
    lines = [
        "| measure | radixserve | transformers | floor | radixserve / transformers | radixserve / floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, o, h, f in rows:
        lines.append(f"| {name} | {o:.1f} | {h:.1f} | {f:.1f} | {o / h:.2f}x | {o / f:.2f} |")
    lines.append(
        f"| time to first token, {PREFILL_LEN}-token prompt (s) | {ttft_ours:.2f} | {ttft_theirs:.2f} | "
        f"{prefill_flop / fl:.2f} | {ttft_theirs / ttft_ours:.2f}x faster | |"
    )
    lines.append(f'| start-up: `Engine(dtype="bfloat16")` in process (s) | {engine_build_s:.1f} | | | | |')
    lines.append(f"| start-up: fresh interpreter, import + engine + 1 token (s) | {startup_s:.1f} | | | | |")
    table = "\n".join(lines)
    notes = (
        f"Floors, measured in this run: copy bandwidth {bw / 1e9:.1f} GB/s (read + write of a 1 GiB tensor), "
        f"{step_bytes / 1e9:.3f} GB of bf16 weights read per decode step, so at most {1 / floor_step_s:.1f} steps/s; "
        f"bf16 matmul {fl / 1e9:.0f} GFLOP/s, {prefill_flop / 1e9:.0f} GFLOP of projections in a {PREFILL_LEN}-token "
        f"prefill. Medians of {args.repeats} interleaved repeats; decode: {args.new_tokens} greedy tokens per request "
        f"after {DECODE_PROMPT_LEN}-token prompts. Load average {load_before} before, {load_average()} after."
    )
    print(table)
    print(notes)
    if args.no_record:
        return
    section = (
        f"\n## CPU speed of the default model vs transformers and the machine's floors (issue 3)\n\n"
        f"- Date: {started:%Y-%m-%d %H:%M}. Machine: {machine()}; shared with other jobs.\n"
        f"- Commit: {git_commit()}. Command: `.venv/bin/python -m benchmarks.cpu_speed --repeats {args.repeats} "
        f"--new-tokens {args.new_tokens}`\n"
        f"- Model: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized; both sides load our converted folder), "
        f"bfloat16. transformers {__import__('transformers').__version__}: one forward per token with its "
        f"DynamicCache, no scheduler. radixserve: `Engine` defaults (page 16, chunked prefill 512, radix cache flushed "
        f"before each measurement).\n\n{table}\n\n{notes}\n"
    )
    results = ROOT / "benchmarks" / "RESULTS.md"
    with results.open("a") as f:  # append only: other benchmarks add their own sections
        f.write(section)
    print(f"appended to {results}")


if __name__ == "__main__":
    main()
