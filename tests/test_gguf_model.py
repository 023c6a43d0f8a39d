"""A model loaded with quantization "gguf" (radixserve/model/gguf_model.py): every projection over the file's own
blocks, against the float32 model converted from the same file (the same blocks dequantized by gguf-py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from radixserve.model.gguf_linear import GGUFEmbedding, GGUFLinear
from radixserve.model.loader import load_model
from radixserve.model.resolve import resolve_model

TYPES = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q5_0,
    "ffn_gate": T.Q8_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q4_0,
    "token_embd": T.Q8_0,
    "output": T.Q5_0,
}
# The only difference from the float32 model is the kernels' int8 rounding of activations per block of 32
# (~0.5% of a product on random inputs, tests/test_gguf_kernels.py).
ACT_TOL = 0.02


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # llama: llama.cpp's permuted Q/K rows are undone on the blocks
def test_gguf_model_matches_the_converted_float_model(arch, tiny_model_factory, tmp_path):
    from test_gguf import write_gguf

    gguf_path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tiny_model_factory(arch), TYPES)
    folder = resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    cfg, dense = load_model(folder, torch.float32)
    _, native = load_model(folder, torch.float32, quantization="gguf")
    ids = torch.arange(cfg.vocab_size)
    assert isinstance(native.embed_tokens, GGUFEmbedding)
    assert torch.equal(native.embed_tokens(ids), dense.embed_tokens(ids))
    head = native.lm_head if native.lm_head is not None else native.tied_head
    pairs = [(head, dense.lm_head.weight if dense.lm_head is not None else dense.embed_tokens.weight, None)]
    for i in range(cfg.num_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            ref = dense.get_submodule(f"layers.{i}.{name}")
            pairs.append((native.get_submodule(f"layers.{i}.{name}"), ref.weight, ref.bias))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(
                native.get_submodule(f"layers.{i}.{norm}").weight, dense.get_submodule(f"layers.{i}.{norm}").weight
            )
    torch.manual_seed(0)
    for lin, weight, bias in pairs:
        assert isinstance(lin, GGUFLinear)
        x = torch.randn(5, lin.in_features)
        ref = x @ weight.T + (0 if bias is None else bias)
        assert ((lin(x) - ref).norm() / ref.norm()).item() <= ACT_TOL
        if lin is head:  # float32 logits from bfloat16 hidden rows, the same numbers as from their float32 widening
            assert torch.equal(lin(x.bfloat16()), lin(x.bfloat16().float()))
        else:
            assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert not any(p.numel() > cfg.hidden_size for p in native.parameters() if p.dim() == 2)  # no float matrix


def test_each_linear_prefetches_the_next_ones_in_step_order(tiny_model_factory, tmp_path):
    """After each linear the kernels' pool prefetches the blocks of the linears a decode step runs next (each
    layer's qkv, o, gate_up, down, the LM head, then the first layer's for the next step), and the values do not
    change."""
    from test_gguf import write_gguf

    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    cfg, native = load_model(
        resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False), torch.float32, quantization="gguf"
    )
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    order = [native.get_submodule(f"layers.{i}.{n}") for i in range(cfg.num_layers) for n in names]
    order.append(native.lm_head if native.lm_head is not None else native.tied_head)
    for i, lin in enumerate(order):
        after = [p.blocks for nxt in order[i + 1 :] + order[:i] for p in nxt.parts]
        assert lin._ahead is not None and [id(t) for t in lin._ahead] == [id(t) for t in after]  # all: a tiny model
    x = torch.randn(3, order[0].in_features)
    y = order[0](x)
    order[0]._ahead = None
    assert torch.equal(order[0](x), y)


def test_gguf_quantization_needs_a_gguf_source(tiny_model_factory):
    with pytest.raises(ValueError, match="not converted from one"):
        load_model(tiny_model_factory("qwen2"), torch.float32, quantization="gguf")


def test_tensor_table_equals_gguf_py(tiny_model_factory, tmp_path):
    """The fast header walk (radixserve/gguf/tensor_table.py) finds every tensor gguf-py finds, with its bytes."""
    import gguf
    import numpy as np
    from test_gguf import write_gguf

    from radixserve.gguf.tensor_table import read_tensor_table

    path = write_gguf(tmp_path / "tiny.gguf", "llama", tiny_model_factory("llama"), TYPES)
    table = read_tensor_table(path)
    reader = gguf.GGUFReader(path, "r")
    assert table.architecture == "llama" and set(table.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ours = table.tensors[t.name]
        assert ours.type == t.tensor_type and ours.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(ours.data, np.asarray(t.data).view(np.uint8).reshape(-1))
    assert read_tensor_table(path, metadata=True).metadata == {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")
    }  # every value, the tokenizer's arrays of strings and integers included, as gguf-py decodes it
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ValueError):
        read_tensor_table(tmp_path / "bad.gguf")


def test_every_weight_format_serves_a_gguf_and_auto_follows_gguf_auto(tiny_model_factory, tmp_path, make_engine):
    """`quantization` none, int8, int4 and gguf all serve a GGUF (none, int8, int4 from its blocks dequantized in
    memory); "auto" means cpu_select.GGUF_AUTO for it and int8 for the Hugging Face folder it came from."""
    from test_gguf import write_gguf

    from radixserve.model import cpu_select

    hf_dir = tiny_model_factory("qwen2")
    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", hf_dir, TYPES)
    cache = tmp_path / "cache"
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    for quantization in ("none", "int8", "int4", "gguf"):
        eng = make_engine(resolve_model(gguf_path, cache_dir=cache, progress=False), quantization=quantization)
        assert eng.quantization == quantization
        assert len(eng.generate(input_ids=[5, 17, 42], sampling_params=params)["output_ids"]) == 4
    if cpu_select.cpu_kind() in ("AVX512_BF16", "AMX"):  # where the table's auto is int8 and bf16 has hardware
        folder = resolve_model(gguf_path, cache_dir=cache, progress=False)
        assert make_engine(folder, dtype="auto").quantization == cpu_select.GGUF_AUTO
        assert make_engine(hf_dir, dtype="auto").quantization == "int8"


def test_auto_re_quantizes_a_gguf_with_block_types_we_have_no_kernel_for(tiny_model_factory, tmp_path, make_engine):
    """A file with a Q4_1 matrix (no kernel of ours) still serves at the defaults: "auto" re-quantizes it where it
    would run the blocks; asking for its blocks says what to ask for instead."""
    from test_gguf import write_gguf

    from radixserve.model import cpu_select

    gguf_path = write_gguf(
        tmp_path / "q4_1.gguf", "qwen2", tiny_model_factory("qwen2"), {**TYPES, "attn_output": T.Q4_1}
    )
    folder = resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match="Q4_1 have no kernel.*--quantization int8"):
        load_model(folder, torch.float32, quantization="gguf")
    eng = make_engine(folder, dtype="auto")
    if cpu_select.choose("auto", "auto", "cpu", gguf_model=True).quantization == "gguf":
        assert eng.quantization == cpu_select.CHOICES[cpu_select.cpu_kind()][1]  # the table's own format: int8
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert len(eng.generate(input_ids=[5, 17, 42], sampling_params=params)["output_ids"]) == 4


def test_an_engine_at_auto_reads_the_tensor_table_once(tiny_model_factory, tmp_path, make_engine, monkeypatch):
    """Engine() checks the file's block types before choosing its weights, and the load takes that same table: one
    header walk (two cost ~37 ms on the default model)."""
    from test_gguf import write_gguf

    from radixserve.model import cpu_select, gguf_model

    if cpu_select.choose("auto", "auto", "cpu", gguf_model=True).quantization != "gguf":
        pytest.skip("auto does not run a GGUF's own blocks on this CPU")
    folder = resolve_model(
        write_gguf(tmp_path / "m.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES),
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    reads = []
    real = gguf_model.read_tensor_table
    monkeypatch.setattr(gguf_model, "read_tensor_table", lambda path: reads.append(path) or real(path))
    eng = make_engine(folder, dtype="auto")
    assert eng.quantization == "gguf" and len(reads) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_runs_the_mlp_in_row_chunks_with_the_same_bits(dtype, tiny_model_factory, tmp_path, monkeypatch):
    """Over the GGUF kernels the MLP runs MLP_ROWS rows at a time (less peak memory at a prefill chunk), and since a
    row's result does not depend on the call's other rows, the output is bit-equal to one call over all rows."""
    import radixserve.model.llama as llama
    from test_gguf import write_gguf

    gguf_path = write_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_model_factory("qwen2"), TYPES)
    _, native = load_model(
        resolve_model(gguf_path, cache_dir=tmp_path / "cache", progress=False), dtype, quantization="gguf"
    )
    mlp = native.layers[0].mlp
    assert mlp.gate_up_proj.row_invariant
    calls = []
    mlp.gate_up_proj.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    x = torch.randn(300, mlp.gate_up_proj.in_features).to(dtype)
    monkeypatch.setattr(llama, "MLP_ROWS", 128)
    chunked = mlp(x)
    monkeypatch.setattr(llama, "MLP_ROWS", 1 << 20)
    whole = mlp(x)
    assert calls == [128, 128, 44, 300]
    assert torch.equal(chunked, whole)
