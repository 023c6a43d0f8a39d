"""GPU correctness: the flashinfer and triton backends against the torch backend, CUDA-graph replay against eager,
and greedy tokens through the whole Engine across backends with the radix cache on and off.

Each check returns rows (dicts) with an `ok` field; run_all prints them and writes them to the results.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import SMALL, TINY, build_random_model, write_random_checkpoint
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import make_backend

# Per element: |out - ref| <= tol * (1 + |ref|). Both sides round once to the output dtype and differ in summation
# order and in where softmax weights are rounded: about two output roundings.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
BATCHES: dict[str, tuple[list[tuple[int, int]], int]] = {  # (prefix, extend) per request, shared prefix tokens
    "decode": ([(0, 1), (15, 1), (16, 1), (17, 1), (40, 1), (2047, 1)], 0),
    "mixed": ([(0, 5), (19, 1), (33, 1), (16, 21), (0, 16), (47, 1), (3, 2), (300, 200)], 0),
    "fresh_prefill": ([(0, 33), (0, 7), (0, 700)], 0),
    "shared_prefix": ([(64, 1), (64, 9), (80, 1), (70, 30)], 64),
}
# dtype, page_size, heads, kv_heads, head_dim. Llama-3-8B's heads (GQA 4: tensor-core decode), page sizes 16 and 1,
# float16, MHA (CUDA-core decode), and the default model's GQA 7 at head_dim 64. Each FlashInfer module compiles
# on first use, so the list stays short.
CASES = [
    (torch.bfloat16, 16, 32, 8, 128),
    (torch.bfloat16, 1, 32, 8, 128),
    (torch.float16, 16, 32, 8, 128),
    (torch.bfloat16, 16, 16, 16, 128),
    (torch.bfloat16, 16, 14, 2, 64),  # the default model's heads (Qwen2.5-0.5B): GQA 7, head_dim 64
]


def random_batch(
    lens: list[tuple[int, int]],
    shared_tokens: int,
    page_size: int,
    num_pages: int,
    rng: random.Random,
    device: torch.device,
) -> ForwardBatch:
    """Requests over shuffled distinct pages, the pages of the first `shared_tokens` tokens common to all."""
    free = list(range(1, num_pages))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_tokens // page_size)]
    tables = [shared + [free.pop() for _ in range(math.ceil((p + e) / page_size) - len(shared))] for p, e in lens]
    chunks = [[rng.randrange(100) for _ in range(e)] for _, e in lens]
    return ForwardBatch.build(chunks, [p for p, _ in lens], tables, page_size, [0], device)


def attention_parity(device: torch.device, backends: list[str]) -> list[dict[str, Any]]:
    """One planned step, two layers, each backend on its own copy of the same random pool vs the torch backend."""
    rows = []
    for dtype, page_size, heads, kv_heads, head_dim in CASES:
        # the head shape make_backend reads off a ModelConfig
        shape = ModelConfig.from_hf(
            {**SMALL, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
        )
        for kind, (lens, shared) in BATCHES.items():
            seed = random.SystemRandom().randrange(1 << 30)  # fresh inputs every run; the row names the seed
            rng = random.Random(seed)
            gen = torch.Generator(device=device).manual_seed(seed)
            num_pages = 8 + sum(math.ceil((p + e) / page_size) for p, e in lens)
            pools = {
                b: KVPool(2, num_pages, page_size, kv_heads, head_dim, dtype, device) for b in ["torch", *backends]
            }
            for layer in range(2):  # stale random values everywhere: a wrong read picks them up
                for bufs in ("k_buffers", "v_buffers"):
                    values = torch.randn(pools["torch"].k_buffers[0].shape, generator=gen, device=device).to(dtype)
                    for pool in pools.values():
                        getattr(pool, bufs)[layer].copy_(values)
            batch = random_batch(lens, shared, page_size, num_pages, rng, device)
            impls = {b: make_backend(b, pools[b], shape) for b in pools}
            for impl in impls.values():
                impl.plan(batch)
            worst: dict[str, tuple[float, bool]] = {b: (0.0, True) for b in backends}
            for layer in range(2):
                q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen, device=device).to(dtype)
                k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype)
                v = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype)
                ref = impls["torch"].forward(layer, q, k, v).double()
                for b in backends:
                    out = impls[b].forward(layer, q, k, v).double()
                    err = (out - ref).abs()
                    ok = bool((err <= TOLERANCE[dtype] * (1 + ref.abs())).all())
                    ok &= torch.equal(pools[b].k_buffers[layer], pools["torch"].k_buffers[layer])
                    ok &= torch.equal(pools[b].v_buffers[layer], pools["torch"].v_buffers[layer])
                    worst[b] = (max(worst[b][0], float(err.max())), worst[b][1] and ok)
            case = f"{str(dtype).split('.')[-1]} ps{page_size} h{heads}/{kv_heads} d{head_dim} {kind}"
            rows += [
                {"check": "attention vs torch", "case": case, "backend": b, "max_abs_err": e, "seed": seed, "ok": ok}
                for b, (e, ok) in worst.items()
            ]
    return rows


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def graph_parity(
    device: torch.device,
    batch_sizes: tuple[int, ...] = (1, 3, 8, 13, 40, 64, 5, 1),
) -> list[dict[str, Any]]:
    """Decode logits from CUDA-graph replay vs eager flashinfer vs the torch backend, at ladder and padded sizes."""
    from radixserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from radixserve.model.cuda_graph import CudaGraphRunner, padded_batch_size

    dtype, page_size, max_ctx = torch.bfloat16, 16, 1024
    config, model = build_random_model(SMALL, dtype, device, std=0.05)
    num_pages = 2 + max(batch_sizes) * (max_ctx // page_size)
    pool = KVPool(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(3)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen, device=device).to(dtype))
    fi = FlashInferAttentionBackend(pool, config.num_heads, config.head_dim)
    ref = TorchAttentionBackend(pool, config.num_heads, config.head_dim)
    graphs = CudaGraphRunner(model, fi, max_batch_size=64, max_context_len=max_ctx)
    rng, rows = random.Random(5), []
    with torch.inference_mode():
        for bs in batch_sizes:
            lens = [rng.randrange(1, max_ctx) for _ in range(bs)]
            batch = random_batch([(n - 1, 1) for n in lens], 0, page_size, num_pages, rng, device)
            batch.logits_indices = torch.arange(bs, device=device)
            logits = {"graph": graphs.forward(batch)}
            for name, attn in (("eager", fi), ("torch", ref)):
                attn.plan(batch)
                logits[name] = model.compute_logits(model(batch, attn)[batch.logits_indices])
            for name in ("graph", "eager"):
                err = relative_error(logits[name], logits["torch"])
                agree = float((logits[name].argmax(-1) == logits["torch"].argmax(-1)).float().mean())
                rows.append(
                    {
                        "check": "decode logits vs torch",
                        "case": f"bs {bs} (graph of {padded_batch_size(bs, graphs.sizes)})",
                        "backend": name,
                        "rel_err": err,
                        "argmax_agree": agree,
                        "ok": err < 2e-2,
                    }
                )
    return rows


GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
# A run's rounding noise: the largest |logprob - reference logprob| of the tokens it shares with the reference. A
# divergence is a near-tie when the reference's top-2 margin there is within twice that noise (each of the two
# logprobs may be off by it). The noise itself must stay under the dtype's cap, or the numerics are broken.
NOISE_CAP = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.3}


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((j for j in range(len(want)) if j >= len(got) or got[j] != want[j]), None)


def greedy_model(device: torch.device, workdir: Path, smoke: bool) -> tuple[Path, list[list[int]]]:
    """The random checkpoint of the greedy checks and their prompts: four sharing a 100-token prefix, three not,
    one longer than the prefill chunk."""
    model_dir = write_random_checkpoint(
        workdir / ("tiny" if smoke else "small"), TINY if smoke else SMALL, device, std=0.05
    )
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(100)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 40, 17)]
    prompts += [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 37, 600)]  # 600 > chunk: chunked prefill
    return model_dir, prompts


def greedy_runs(
    model_dir: Path, device: torch.device, prompts: list[list[int]], params: dict[str, Any], **engine: Any
) -> list[list[dict[str, Any]]]:
    """Two passes of the prompts through one Engine (the second served from its cache where the cache is on)."""
    from radixserve import Engine

    with Engine(model=model_dir, device=str(device), chunked_prefill_size=256, max_total_tokens=16384, **engine) as eng:
        return [
            eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            for _ in range(2)
        ]


def compare_greedy(results: list[dict[str, Any]], reference: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """A run passes when its tokens equal the reference's, or its first divergence is a near-tie of the reference
    (see NOISE_CAP; the row lists every margin)."""
    diverged, noise = [], 0.0
    for i, (got, want) in enumerate(zip(results, reference)):
        at = first_divergence(got["output_ids"], want["output_ids"])
        shared = zip(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])
        noise = max([noise] + [abs(a[0] - b[0]) for a, b in list(shared)[:at]])
        if at is not None:
            top = want["meta_info"]["output_top_logprobs"][at]
            diverged.append((i, at, top[0][0] - top[1][0]))
    return {
        "identical": f"{len(reference) - len(diverged)}/{len(reference)}",
        "noise": noise,
        "diverged (prompt, token, ref margin)": ", ".join(f"({i}, {t}, {m:.4f})" for i, t, m in diverged),
        "ok": noise < NOISE_CAP[dtype] and all(m <= 2 * noise for _, _, m in diverged),
    }


def greedy_parity(
    device: torch.device,
    workdir: Path,
    backends: list[str],
    smoke: bool = False,
) -> list[dict[str, Any]]:
    """Greedy tokens through the Engine against a float32 torch-backend reference: every backend and dtype, cache
    on and off, overlap on and off, and a second pass served from the cache (compare_greedy says what passes).
    `attention_backend=None` in float32 is the engine's own choice (triton on CUDA: flashinfer has no float32).
    """
    model_dir, prompts = greedy_model(device, workdir, smoke)

    def run(dtype: str, backend: str | None, cache: bool, overlap: bool) -> list[list[dict[str, Any]]]:
        return greedy_runs(
            model_dir,
            device,
            prompts,
            GREEDY,
            dtype=dtype,
            attention_backend=backend,
            enable_radix_cache=cache,
            overlap_schedule=overlap,
        )

    reference = run("float32", "torch", True, False)[0]
    configs = [("float32", None, True, True)]
    configs += [
        (dtype, backend, cache, overlap)
        for dtype in ("float16", "bfloat16")
        for backend in ["torch", *backends]
        for cache in (True, False)
        for overlap in (False, True)
    ]
    rows = []
    for dtype, backend, cache, overlap in configs:
        for pass_no, results in enumerate(run(dtype, backend, cache, overlap), 1):
            case = f"cache {'on' if cache else 'off'}, overlap {'on' if overlap else 'off'}, pass {pass_no}"
            rows.append(
                {"check": f"greedy {dtype} vs float32", "backend": backend or "default", "case": case}
                | compare_greedy(results, reference, dtype)
            )
    return rows


# Quantized KV pages per backend: FlashInfer reads fp8_e4m3, our Triton kernels int8 (radixserve_kernels/kv_load.py).
KV_PAGE_BACKENDS = {"fp8_e4m3": "flashinfer", "int8": "triton"}
PENALTIES = GREEDY | {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2}


def kv_page_parity(
    device: torch.device, workdir: Path, backends: list[str], smoke: bool = False
) -> list[dict[str, Any]]:
    """Quantized KV pages on the GPU: greedy bfloat16 tokens of the GPU backend that reads each format against the
    torch backend over the same pages (which decodes them to floats first), cache on and off; and the penalties
    (prompt + output ids kept per request, radixserve/sampling/info.py) on the default backend against torch.
    Informational row: how far each quantized format's tokens are from bfloat16 pages on the torch backend."""
    model_dir, prompts = greedy_model(device, workdir, smoke)
    rows = []

    def run(
        backend: str | None,
        kv: str,
        params: dict[str, Any],
        cache: bool = True,
        overlap: bool = False,
        dtype: str = "bfloat16",
    ) -> list[list[dict[str, Any]]]:
        return greedy_runs(
            model_dir,
            device,
            prompts,
            params,
            dtype=dtype,
            attention_backend=backend,
            kv_cache_dtype=kv,
            enable_radix_cache=cache,
            overlap_schedule=overlap,
        )

    bf16_pages = run("torch", "auto", GREEDY)[0]
    for kv, backend in KV_PAGE_BACKENDS.items():
        reference = run("torch", kv, GREEDY)[0]
        info = compare_greedy(reference, bf16_pages, "bfloat16") | {"ok": None}  # how far the format moves tokens
        rows.append({"check": f"{kv} pages vs bfloat16 pages (info)", "backend": "torch", "case": "cache on"} | info)
        if backend not in backends:
            continue
        for cache, overlap in ((True, True), (False, False)):
            for pass_no, results in enumerate(run(backend, kv, GREEDY, cache, overlap), 1):
                case = f"cache {'on' if cache else 'off'}, overlap {'on' if overlap else 'off'}, pass {pass_no}"
                rows.append(
                    {"check": f"greedy bfloat16, {kv} pages vs torch", "backend": backend, "case": case}
                    | compare_greedy(results, reference, "bfloat16")
                )
    # Logprobs are the raw log_softmax, before penalties, so a near-tie cannot be judged from them: the penalties run
    # in float32 (noise ~1e-5) and must give the reference's tokens exactly, on the engine's default backend.
    reference = run("torch", "auto", PENALTIES, dtype="float32")[0]
    plain = run("torch", "auto", GREEDY, dtype="float32")[0]
    changed = sum(a["output_ids"] != b["output_ids"] for a, b in zip(reference, plain))
    for pass_no, results in enumerate(run(None, "auto", PENALTIES, overlap=True, dtype="float32"), 1):
        row = compare_greedy(results, reference, "float32")
        rows.append(
            {"check": "penalties float32 vs torch", "backend": "default", "case": f"overlap on, pass {pass_no}"}
            | row
            | {"ok": row["identical"] == f"{len(prompts)}/{len(prompts)}" and changed > 0, "penalised prompts": changed}
        )
    return rows
