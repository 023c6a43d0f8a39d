"""Micro-benchmark through each server: prefill tokens/s and decode tokens/s at batch 1, 4, 16; and the machine's
memory bandwidth with the decode ceiling it implies for each weight format (bytes read per decode step / bandwidth).

Decode at batch B: B distinct short prompts sent together generating N tokens each (ignore_eos), and B other distinct
prompts of the same length generating 1 token; decode tokens/s = B * (N - 1) / (wall_N - wall_1). The difference takes
out prefill and HTTP set-up, and needs no per-token timestamps (servers stream several tokens per chunk at times).
Prefill: distinct long prompts, one token each, one at a time: prompt tokens / request time (median over repeats).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.compare.client import Replay, Session, Step
from benchmarks.compare.workloads import Size, distinct_prompts


def measure_bandwidth(threads: int, mib: int = 1024, repeats: int = 8) -> float:
    """Memory read bandwidth in GB/s with `threads` threads, as decode uses it (it streams the weights): the best of
    `repeats` sums over a `mib` MiB buffer, in float32 and in bfloat16 (the faster of the two kernels counts)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for dtype in (torch.float32, torch.bfloat16):
            buf = torch.ones(mib * 2**20 // dtype.itemsize, dtype=dtype)
            for _ in range(repeats):
                t = time.perf_counter()
                buf.sum()
                best = max(best, mib * 2**20 / (time.perf_counter() - t) / 1e9)
            del buf
        return best
    finally:
        torch.set_num_threads(old)


def radix_bytes_per_param(url: str) -> float | None:
    """Bytes per weight a radixserve server reads at decode, from its /get_model_info: int8 1, int4 ~0.5 (plus its
    scales, left out), None when it runs the GGUF's own blocks (it reads what llama.cpp reads), else its dtype's
    size."""
    info = httpx.get(f"{url}/get_model_info", timeout=30).json()
    if info.get("quantization") == "gguf":
        return None
    by_format = {"int8": 1.0, "int4": 0.5}
    return by_format.get(info.get("quantization", "none"), 4.0 if info.get("dtype") == "float32" else 2.0)


def hf_decode_bytes(hf_dir: Path, bytes_per_param: float = 2) -> int:
    """Weight bytes one decode step reads from a HF folder's safetensors, at bytes_per_param (bf16: 2): every tensor
    but the input embedding, of which a step reads one row (unless it is tied to the output head)."""
    tied = json.loads((hf_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    params = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name == "__metadata__" or (name.endswith("embed_tokens.weight") and not tied):
                continue
            n = 1
            for d in meta["shape"]:
                n *= d
            params += n
    return int(params * bytes_per_param)


def gguf_decode_bytes(gguf: Path, bytes_per_param: float | None = None) -> int:
    """Weight bytes one decode step reads from a GGUF: every tensor but token_embd (unless there is no output
    tensor), as stored (bytes_per_param None: llama.cpp, or radixserve on the file's blocks) or at bytes_per_param
    (the formats radixserve re-quantizes them to)."""
    from radixserve.gguf.tensor_table import read_tensor_table

    tensors = read_tensor_table(gguf).tensors
    tied = "output.weight" not in tensors
    read = [t for name, t in tensors.items() if tied or name != "token_embd.weight"]
    if bytes_per_param is None:
        return sum(int(t.data.nbytes) for t in read)
    return int(sum(math.prod(t.shape) for t in read) * bytes_per_param)


def _batch_wall(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[Any]]:
    replay = Replay(url, concurrency=len(prompts))
    wall = asyncio.run(replay.run([Session([[Step(max_tokens, prompt=p)]]) for p in prompts]))
    return wall, replay.results


def micro(url: str, tok: Any, size: Size) -> dict[str, Any]:
    """Prefill tokens/s and decode tokens/s per batch size of the server at url."""
    rates, prompt_tokens = [], 0
    for p in distinct_prompts(tok, size.micro_prefill_repeats, size.micro_prefill_tokens, seed=11):
        _, (r,) = _batch_wall(url, [p], 1)
        rates.append(r.prompt_tokens / r.e2e)
        prompt_tokens = r.prompt_tokens
    out: dict[str, Any] = {
        "prefill_tok_s": statistics.median(rates),
        "prefill_prompt_tokens": prompt_tokens,
        "decode_tokens": size.micro_decode_tokens,
        "decode_tok_s": {},
    }
    n = size.micro_decode_tokens
    for b in size.micro_batches:
        wall_1, _ = _batch_wall(url, distinct_prompts(tok, b, 32, seed=100 + b), 1)
        wall_n, results = _batch_wall(url, distinct_prompts(tok, b, 32, seed=200 + b), n)
        if any(r.completion_tokens != n for r in results):
            raise RuntimeError(f"asked {n} tokens per request, got {[r.completion_tokens for r in results]}")
        out["decode_tok_s"][str(b)] = b * (n - 1) / max(wall_n - wall_1, 1e-9)
    return out
