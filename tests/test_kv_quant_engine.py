"""Engines on quantized KV pages (issue 40), tiny models: --kv-cache-gb sizes the pool by format (int8 1.86x
bfloat16's tokens at head_dim 64, where key rows are 72 bytes and value rows 66; 1.78x at head_dim 16, where both are
one group of 18); the disk tier stores int8 pages of both widths as they are (greedy output identical with the tier on
and off under heavy eviction); int8 KV stays close to float KV; a backend refuses a format
it cannot read. Every engine ends at rest (the make_engine fixture)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.errors import ParamError
from radixserve.model.key_center import center_keys

GREEDY = {"max_new_tokens": 8, "temperature": 0}
INT8 = {"kv_cache_dtype": "int8", "page_size": 4, "max_total_tokens": 96}


def prompts(n: int = 6) -> list[list[int]]:
    return [list(range(300, 340)) + [(7 * i + j) % 500 + 3 for j in range(24)] for i in range(n)]


def run(engine, ids: list[list[int]]) -> list[list[int]]:
    return [engine.generate(input_ids=x, sampling_params=GREEDY)["output_ids"] for x in ids]


@pytest.fixture(scope="module")
def dim64_model_dir(tiny_model_factory) -> Path:
    """A tiny model of head_dim 64 (the default model's), where int8 key and value rows differ in width."""
    return tiny_model_factory("qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize(("dim", "ratio"), [(64, 256 / 138), (16, 32 / 18)])
def test_the_budget_holds_about_twice_the_tokens_in_int8(
    make_engine, tiny_model_dir, dim64_model_dir, dim: int, ratio: float
) -> None:
    """bfloat16 rows are 2 * head_dim bytes; int8 rows head_dim bytes and a 2-byte scale per group: keys per 16,
    values one a row (head_dim 64: 72 + 66 bytes against 256; head_dim 16: 18 + 18 against 64)."""
    sizes = {}
    for fmt in ("bfloat16", "int8"):
        eng = make_engine(
            dim64_model_dir if dim == 64 else tiny_model_dir, kv_cache_gb=0.001, kv_cache_dtype=fmt, page_size=4
        )
        pool = eng.runner.pool
        assert pool.head_dim == dim
        sizes[fmt] = pool.capacity * pool.page_size
        assert pool.num_pages * pool.page_size * pool.bytes_per_token <= (1 << 30) * 0.001 + 4 * pool.bytes_per_token
    assert sizes["int8"] / sizes["bfloat16"] == pytest.approx(ratio, rel=0.01), sizes
    with pytest.raises(ParamError, match="set one"):
        make_engine(tiny_model_dir, kv_cache_gb=0.001, max_total_tokens=64)


def test_int8_pages_through_the_disk_tier_give_identical_output(make_engine, dim64_model_dir, tmp_path: Path) -> None:
    on = make_engine(dim64_model_dir, kv_cache_dir=tmp_path, **INT8)
    off = make_engine(dim64_model_dir, **INT8)
    ids = prompts()  # 6 x 64 tokens: 96 pages of KV for a pool of 24
    for _ in range(2):
        assert run(on, ids) == run(off, ids)
    s = on.cache_stats()
    assert s["disk_hit_tokens"] > 0 and s["loaded_pages"] > 0
    # The explorer's bytes count the int8 format: 72-byte key rows (a 2-byte scale per 16) and 66-byte value rows.
    pool, cfg = on.runner.pool, on.runner.config
    assert s["device_bytes"] == s["device_pages"] * pool.page_size * pool.bytes_per_token
    assert cfg.head_dim == 64 and pool.bytes_per_token == cfg.num_layers * cfg.num_kv_heads * (72 + 66)


def test_int8_kv_stays_close_to_float_kv(make_engine, tiny_model_dir) -> None:
    """Greedy tokens of the tiny random model mostly agree; the first token's logprob within 0.05."""
    quant = make_engine(tiny_model_dir, **INT8)
    ref = make_engine(tiny_model_dir, page_size=4, max_total_tokens=96)
    agree = total = 0
    for ids in prompts(4):
        a, b = (e.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True) for e in (quant, ref))
        la, lb = a["meta_info"]["output_token_logprobs"][0][0], b["meta_info"]["output_token_logprobs"][0][0]
        assert abs(la - lb) < 0.05, (la, lb)
        agree += sum(x == y for x, y in zip(a["output_ids"], b["output_ids"]))
        total += len(b["output_ids"])
    assert agree >= 0.75 * total, (agree, total)


@pytest.fixture(scope="module")
def key_bias_model_dir(dim64_model_dir, tmp_path_factory) -> Path:
    """dim64_model_dir with a k_proj bias of norm ~240 per KV head on its 8 slowest rotary pairs (channels 24-31 and
    56-63, which turn by under 0.07 rad over 64 positions), the keys' own spread ~1 around it: the shape of Qwen2.5's
    layer-0 keys (a mean of norm ~270 per KV head, 94% of it on pairs that turn by under pi/3 over 8k positions)."""
    out = tmp_path_factory.mktemp("key-bias")
    for f in dim64_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    slow = torch.zeros(64)
    slow[24:32] = slow[56:64] = 1
    for name, w in weights.items():
        if name.endswith("k_proj.bias"):
            weights[name] = w + 60 * torch.randn(w.shape, generator=gen) * slow.repeat(w.numel() // 64)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def scored(engine, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens after `ids`, and the logprob of every prompt token (prefill over the stored pages) then of
    every generated one (one-token decode steps)."""
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    return out["output_ids"], [lp for lp, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def test_centering_the_keys_leaves_attention_unchanged(make_engine, key_bias_model_dir) -> None:
    """float32 KV pages, keys centered by the k bias (what int8 pages get): softmax ignores a vector added to every
    key of a head, so the tokens and logprobs are the float engine's, through prefill, decode and cached prefixes."""
    plain = make_engine(key_bias_model_dir, page_size=4, max_total_tokens=256)
    centered = make_engine(key_bias_model_dir, page_size=4, max_total_tokens=256)
    center_keys(centered.runner.model, torch.float32)
    assert all(layer.self_attn.k_center is not None for layer in centered.runner.model.layers)
    for ids in prompts(3) * 2:  # the second pass reads the first's cached pages
        (ta, la), (tb, lb) = scored(plain, ids), scored(centered, ids)
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_int8_pages_of_centered_keys_keep_a_large_k_bias_from_costing_precision(
    make_engine, key_bias_model_dir
) -> None:
    """Keys that are mostly their bias: int8 rows scaled by the bias round the keys' own part coarsely (uncentered:
    a mean logprob error many times the centered one); stored centered, int8 stays close to float32 KV."""
    ref = make_engine(key_bias_model_dir, page_size=4, max_total_tokens=256)
    quant = make_engine(key_bias_model_dir, **INT8)
    uncentered = make_engine(key_bias_model_dir, **INT8)
    assert all(layer.self_attn.k_center is not None for layer in quant.runner.model.layers)
    for layer in uncentered.runner.model.layers:
        layer.self_attn.k_center = None
    err: dict[str, list[float]] = {"centered": [], "uncentered": []}
    for ids in prompts(4):
        tokens, want = scored(ref, ids)
        for name, eng in (("centered", quant), ("uncentered", uncentered)):
            got_tokens, got = scored(eng, ids)
            n = len(ids) - 1 + next((i for i, (a, b) in enumerate(zip(tokens, got_tokens)) if a != b), len(tokens))
            err[name] += [abs(x - y) for x, y in zip(want[:n], got[:n])]
    mean = {name: sum(e) / len(e) for name, e in err.items()}
    assert mean["centered"] < 0.03, mean  # measured 0.010, as int8 KV of this model without the bias (0.011)
    assert mean["uncentered"] > 5 * mean["centered"], mean  # measured 0.16-0.17


def test_backends_refuse_a_format_they_cannot_read(make_engine, tiny_model_dir) -> None:
    """fp8 pages are float8 bits held as uint8: the Triton kernels would read integers; FlashInfer needs CUDA."""
    with pytest.raises(ValueError, match="float and int8 KV pages"):
        make_engine(tiny_model_dir, attention_backend="triton", kv_cache_dtype="fp8_e4m3", max_total_tokens=64)
    with pytest.raises(ValueError, match="CUDA"):
        make_engine(tiny_model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3", max_total_tokens=64)
