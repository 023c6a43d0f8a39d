"""LlamaForCausalLM + loader + torch backend against transformers on the same tiny random weights (float32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import Linear, LlamaForCausalLM, can_pack
from radixserve.model.loader import iter_safetensors, load_model, safetensors_files
from radixserve.model.rope import rope_inv_freq
from tiny_models import ARCHS, make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32, max abs difference of logits
VOCAB = 512


@pytest.fixture(scope="module", params=ARCHS)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, ModelConfig, LlamaForCausalLM, object]:
    arch = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, vocab_size=VOCAB)
    config, model = load_model(path, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return arch, config, model, hf


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf: object, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]


class PagedRunner:
    """Drives our model step by step with a KV pool whose pages are handed out in a shuffled order."""

    def __init__(
        self,
        config: ModelConfig,
        model: LlamaForCausalLM,
        page_size: int,
        num_pages: int = 160,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.page_size = model, page_size
        self.pool = KVPool(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, dtype)
        self.attn = TorchAttentionBackend(self.pool, config.num_heads, config.head_dim)
        self.free = list(range(1, num_pages))
        random.Random(page_size).shuffle(self.free)  # non-contiguous, non-monotonic page ids
        self.tables: dict[str, list[int]] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """Run one packed forward of (request, new tokens, prefix length) chunks; logits of every new token per chunk."""
        tables = []
        for rid, toks, prefix in chunks:
            table = self.tables.setdefault(rid, [])
            while len(table) * self.page_size < prefix + len(toks):
                table.append(self.free.pop())
            tables.append(table)
        total = sum(len(t) for _, t, _ in chunks)
        batch = ForwardBatch.build(
            [t for _, t, _ in chunks], [p for _, _, p in chunks], tables, self.page_size, list(range(total))
        )
        self.attn.plan(batch)
        logits = self.model.compute_logits(self.model(batch, self.attn)[batch.logits_indices])
        return list(logits.split([len(t) for _, t, _ in chunks]))


def check(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max abs logit difference {diff}"


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_prompt_one_forward(tiny, page_size: int) -> None:
    _, config, model, hf = tiny
    ids = tokens(40, 0)
    (ours,) = PagedRunner(config, model, page_size).step([("a", ids, 0)])
    check(ours, hf_logits(hf, ids))


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_then_extend_reads_pool_pages(tiny, page_size: int) -> None:
    _, config, model, hf = tiny
    ids = tokens(40, 1)
    ref = hf_logits(hf, ids)
    run = PagedRunner(config, model, page_size)
    (first,) = run.step([("a", ids[:23], 0)])
    (second,) = run.step([("a", ids[23:], 23)])
    check(first, ref[:23])
    check(second, ref[23:])


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_prefill_chunk_and_decodes(tiny, page_size: int) -> None:
    _, config, model, hf = tiny
    a, b, c = tokens(40, 2), tokens(14, 3), tokens(33, 4)
    run = PagedRunner(config, model, page_size)
    run.step([("b", b[:13], 0), ("c", c[:32], 0)])
    run.step([("a", a[:21], 0)])
    # One step: the second prefill chunk of `a` packed with one decode token each of `b` and `c`.
    out_b, out_a, out_c = run.step([("b", b[13:], 13), ("a", a[21:], 21), ("c", c[32:], 32)])
    check(out_a, hf_logits(hf, a)[21:])
    check(out_b, hf_logits(hf, b)[13:])
    check(out_c, hf_logits(hf, c)[32:])


@pytest.mark.parametrize("page_size", [1, 16])
def test_step_by_step_decode(tiny, page_size: int) -> None:
    _, config, model, hf = tiny
    a, b = tokens(26, 5), tokens(19, 6)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    run = PagedRunner(config, model, page_size)
    run.step([("a", a[:5], 0), ("b", b[:3], 0)])
    for i in range(3, 19):  # pure decode batches of two requests, both crossing a page boundary
        out_a, out_b = run.step([("a", [a[i + 2]], i + 2), ("b", [b[i]], i)])
        check(out_a, ref_a[i + 2 : i + 3])
        check(out_b, ref_b[i : i + 1])
    for i in range(21, 26):  # a single request decoding alone
        (out_a,) = run.step([("a", [a[i]], i)])
        check(out_a, ref_a[i : i + 1])


def test_greedy_tokens_match_hf_generate(tiny) -> None:
    _, config, model, hf = tiny
    prompt = tokens(12, 7)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)[
            0, 12:
        ].tolist()
    run = PagedRunner(config, model, 4)
    seq = list(prompt)
    (logits,) = run.step([("a", prompt, 0)])
    for _ in range(10):
        seq.append(int(logits[-1].argmax()))
        (logits,) = run.step([("a", seq[-1:], len(seq) - 1)])
    assert seq[12:] == expected


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "src", "qwen2", vocab_size=VOCAB)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    config, model = load_model(tmp_path / "sharded", torch.float32)
    ids = tokens(40, 8)
    (ours,) = PagedRunner(config, model, 16).step([("a", ids, 0)])
    check(ours, hf_logits(hf, ids))

    # bfloat16 end to end (weights, activations, KV pool): within a few bf16 ulps (0.016 at |logit| ~3) of
    # transformers in bfloat16, and close to the float32 result (measured: ~0.02 and ~0.06).
    config, model16 = load_model(path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    (ours16,) = PagedRunner(config, model16, 16, dtype=torch.bfloat16).step([("a", ids, 0)])
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert (ours16 - hf_logits(hf16, ids)).abs().max().item() < 0.08
    assert (ours16 - ours).abs().max().item() < 0.15


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels for this CPU")
@pytest.mark.parametrize(
    "arch,overrides", [("qwen2", {}), ("llama", {"attention_bias": True})], ids=["tied-qkv-bias", "untied-o-bias"]
)
def test_cpu_packed_bf16_matches_plain(tmp_path: Path, arch: str, overrides: dict) -> None:
    """load_model packs bf16 weights for oneDNN; logits equal the plain F.linear model's, prefill and decode."""
    path = make_tiny_checkpoint(tmp_path, arch, vocab_size=VOCAB, num_hidden_layers=2, **overrides)
    config, packed = load_model(path, torch.bfloat16)
    plain = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    plain.load_weights(iter_safetensors(safetensors_files(path)))
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert (packed.lm_head or packed.tied_head) is not None
    assert not packed.embed_tokens.weight.is_mkldnn  # the lookup still reads plain rows
    ids = tokens(30, 10)
    outs = []
    for model in (packed, plain):
        run = PagedRunner(config, model, 16, dtype=torch.bfloat16)
        (first,) = run.step([("a", ids[:27], 0), ("b", ids[:5], 0)])[:1]
        decodes = [run.step([("a", [t], 27 + i)])[0] for i, t in enumerate(ids[27:])]
        outs.append(torch.cat([first, *decodes]))
    # Same bf16 inputs, float32 accumulation in both; only the summation order may differ.
    assert (outs[0] - outs[1]).abs().max().item() < 0.03


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_model(tmp_path / "absent", torch.float32)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid model config"):
        load_model(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tmp_path, torch.float32)
    good = make_tiny_checkpoint(tmp_path / "good", "llama", vocab_size=VOCAB)
    (tmp_path / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path, torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read weights"):
        load_model(tmp_path, torch.float32)


def test_load_weights_rejects_unexpected_and_missing(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=VOCAB, num_hidden_layers=2)
    config, _ = load_model(path, torch.float32)
    state = dict(transformers.AutoModelForCausalLM.from_pretrained(path).state_dict())
    LlamaForCausalLM(config).load_weights(state.items())  # the complete set loads
    fresh = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="unexpected weight"):
        fresh.load_weights([*state.items(), ("model.layers.9.mlp.gate_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="appears twice"):
        fresh.load_weights([*state.items(), ("model.norm.weight", torch.ones(64))])
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing 1 weight.*model.layers.1.self_attn.k_proj.weight"):
        LlamaForCausalLM(config).load_weights(state.items())
    bad = dict(state, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match="has shape"):
        LlamaForCausalLM(config).load_weights(bad.items())


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ],
)
def test_rope_frequencies_match_transformers(scaling: dict | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=scaling
    )
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        ref, ref_scale = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32)), 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    ours, scale = rope_inv_freq(32, 10000.0, scaling, 1024)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("llama", {"attention_bias": True}),  # bias on q/k/v and o_proj
        ("llama", {"num_key_value_heads": 1}),  # GQA ratio 4
        ("mistral", {"num_key_value_heads": 4}),  # plain multi-head attention
        ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}),  # q width != hidden
    ],
    ids=["linear-rope", "attention-bias", "gqa4", "mha", "wide-heads"],
)
def test_variants_match_hf(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, vocab_size=VOCAB, num_hidden_layers=2, **overrides)
    config, model = load_model(path, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokens(40, 9)
    ref = hf_logits(hf, ids)
    run = PagedRunner(config, model, 16)
    (first,) = run.step([("a", ids[:29], 0)])
    (second,) = run.step([("a", ids[29:], 29)])
    check(torch.cat([first, second]), ref)
