"""Tensor parallelism over gloo on CPU, 2 ranks: the same greedy tokens (and logits) as one rank on every tiny
architecture, KV heads split, replicated (tp a multiple of them) or refused with the head counts named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve import distributed
from radixserve.config import ModelConfig
from radixserve.errors import ParamError, RequestFailedError
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import read_config
from radixserve.model.parallel import plan_shard
from radixserve.model.runner import ModelRunner
from radixserve.tp_worker import worker_settings

# (arch, overrides): every tiny architecture (4 query heads over 2 KV heads: split 1 + 1), MQA (1 KV head:
# replicated on both ranks), and a vocabulary 2 does not divide (the last vocab shard padded), tied and untied.
MODELS = [
    ("llama", {}),
    ("llama3", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {}),
    ("llama", {"num_key_value_heads": 1}),
    ("qwen2", {"vocab_size": 509}),
    ("qwen3", {"vocab_size": 509}),
]
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12, 12, 88, 101, 6, 9, 44, 201, 2, 77]]
STEPS = 6
PAGE_SIZE = 4


def _config(heads: int, kv: int, inter: int = 128, vocab: int = 512) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 16,
        }
    )


def test_split_rules_name_the_head_counts() -> None:
    s = plan_shard(_config(8, 4), 2, 1)
    assert (s.num_heads, s.num_kv_heads, s.kv_start, s.intermediate) == (4, 2, 2, 64)
    # tp a multiple of the KV heads: rank r holds the KV head its 2 query heads use (replicated over 2 ranks)
    assert [
        (plan_shard(_config(8, 2), 4, r).kv_start, plan_shard(_config(8, 2), 4, r).num_kv_heads) for r in range(4)
    ] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    padded = plan_shard(_config(4, 2, vocab=509), 2, 1)
    assert (padded.vocab_rows, padded.vocab_start) == (255, 255)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        plan_shard(_config(4, 2), 3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        plan_shard(_config(6, 3), 2)
    with pytest.raises(ValueError, match="intermediate_size=101"):
        plan_shard(_config(4, 2, inter=101), 2)


def test_engine_refuses_a_split_that_cannot_work(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Before any process starts (or any weight is read): a ParamError on `tp` naming the counts; int8 with tp is
    refused for now."""
    from radixserve import Engine

    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_factory("qwen2"), odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_attention_heads": 6, "num_key_value_heads": 3}))
    with pytest.raises(ParamError, match=r"num_key_value_heads=3 \(with num_attention_heads=6\)") as e:
        Engine(model=odd, dtype="float32", tp=2)
    assert e.value.field == "tp"
    with pytest.raises(ParamError, match="num_attention_heads=4"):
        Engine(model=tiny_model_factory("qwen2"), dtype="float32", tp=3)
    with pytest.raises(ParamError, match="quantization 'int8' is not supported"):
        Engine(model=tiny_model_factory("qwen2"), dtype="float32", quantization="int8", tp=2)


def _greedy(runner: ModelRunner, tp: distributed.TPGroup | None) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill both prompts in one batch, then decode STEPS - 1 tokens each; (tokens, every step's logits)."""
    pool = runner.pool
    tables = [pool.alloc(-(-(len(p) + STEPS) // PAGE_SIZE)) for p in PROMPTS]
    chunks, prefix = [list(p) for p in PROMPTS], [0] * len(PROMPTS)
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    logits = []
    for _ in range(STEPS):
        ends = torch.cumsum(torch.tensor([len(c) for c in chunks]), 0) - 1
        batch = ForwardBatch.build(chunks, prefix, tables, PAGE_SIZE, ends.tolist())
        if tp is not None:
            tp.send_batch(batch)
        logits.append(runner.forward(batch))
        for i, t in enumerate(logits[-1].argmax(-1).tolist()):
            tokens[i].append(t)
            prefix[i] += len(chunks[i])
            chunks[i] = [t]
    for table in tables:
        pool.free(table)
    return tokens, torch.cat(logits)


def test_tp2_matches_tp1_on_every_tiny_architecture(tiny_model_factory: Callable[..., Path]) -> None:
    """One worker process serves the 8 models in turn (rank 0 is this process): each model's TP=2 greedy tokens
    and logits equal TP=1's."""
    paths = [tiny_model_factory(arch, **over) for arch, over in MODELS]
    settings = [worker_settings(str(p), "float32", "cpu", PAGE_SIZE, 256, "torch", 4, None, "none") for p in paths]
    args = dict(
        dtype=torch.float32,
        device=torch.device("cpu"),
        page_size=PAGE_SIZE,
        max_total_tokens=256,
        attention_backend="torch",
        max_running_requests=4,
    )
    tp = distributed.start(2, torch.device("cpu"), [json.dumps(s) for s in settings])
    assert tp is not None and tp.rank == 0
    results = []
    try:
        for i, path in enumerate(paths):
            sharded = ModelRunner(path, tp=tp, **args)
            assert sharded.pool.k_buffers[0].shape[2] == max(1, read_config(path).num_kv_heads // 2)
            results.append(_greedy(sharded, tp))
            if i < len(paths) - 1:
                tp.send_stop()
    except BaseException:
        tp.close(kill=True)
        raise
    tp.close()
    assert all(p.returncode == 0 for p in tp.procs)
    for (arch, over), path, (tokens, logits) in zip(MODELS, paths, results):
        want_tokens, want_logits = _greedy(ModelRunner(path, **args), None)
        assert tokens == want_tokens, (arch, over)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4, msg=f"{arch} {over}")


def test_engine_tp2_gives_tp1_tokens_with_the_prefix_cache(tiny_model_dir: Path, make_engine: Callable) -> None:
    """The whole engine at tp=2: a batch, then a second turn that reuses the first's pages from rank 0's tree. The
    tp=2 engine overlaps scheduling (as on GPUs), so decode inputs name ids still being sampled and rank 0 sends
    the workers the resolved ids."""
    params = {"max_new_tokens": 8, "temperature": 0}
    first = ["Hello, world! How are you today? I am fine, thanks.", "The quick brown fox jumps over the lazy dog"]
    outs = {}
    resolved = []
    for tp in (1, 2):
        eng = make_engine(tiny_model_dir, tp=tp, page_size=4, overlap_schedule=tp == 2)
        if eng.tp is not None:
            send = eng.tp.send_batch
            eng.tp.send_batch = lambda batch, ids=None, copy=None: (
                resolved.append(ids is not None),
                send(batch, ids, copy),
            )[1]
        a = eng.generate(first, params)
        b = eng.generate(first[0] + a[0]["text"] + " And you?", params)
        outs[tp] = ([o["output_ids"] for o in a], b["output_ids"], b["meta_info"]["cached_tokens"])
        assert eng.model_info()["tp"] == tp
    assert outs[2] == outs[1] and outs[2][2] > 0
    assert any(resolved)

    # A fault on rank 0 mid-step: that request fails, the group is marked broken (the worker waits inside a
    # collective rank 0 will never join), and shutdown ends the worker rather than waiting on it.
    def fault(batch: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("injected fault")

    eng.runner.forward = fault
    with pytest.raises(RequestFailedError):
        eng.generate("one more", params)
    assert eng.tp.broken is not None
    eng.shutdown()
    assert eng.tp.procs[0].poll() is not None


def test_tp2_partial_page_reuse_copies_every_ranks_shard(tiny_model_factory: Callable[..., Path], make_engine) -> None:
    """Issue 32: prompts whose cached prefix ends part way through a page reuse its rows by copying them (page 16,
    partial-page reuse on); at tp=2 every rank must copy its own shard of those rows, or the other rank attends
    over an uninitialized page and its logits differ (by 0.28-0.37 in logprob before the fix)."""
    path = tiny_model_factory("qwen3", hidden_size=80, head_dim=20, num_attention_heads=4, num_key_value_heads=2)
    prompts = [f"scale out prompt {i} " + "y " * (20 + 7 * i) for i in range(4)]
    params = {"max_new_tokens": 16, "temperature": 0}
    outs = {}
    for tp in (1, 2):
        eng = make_engine(path, tp=tp, page_size=16)
        runs = [eng.generate(p, params, return_logprob=True, top_logprobs_num=2) for p in prompts]
        outs[tp] = [(r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]) for r in runs]
        assert eng.cache_stats()["partial_page_hit_tokens"] > 0  # the case under test happened
    for (ids1, lps1), (ids2, lps2) in zip(outs[1], outs[2]):
        assert ids2 == ids1
        torch.testing.assert_close(torch.tensor(lps2), torch.tensor(lps1), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_torchrun_starts_the_ranks_itself(tiny_model_dir: Path, make_engine: Callable) -> None:
    """torchrun-compatible: `torchrun --nproc-per-node 2 -m radixserve.cli generate --tp 2` prints tp=1's answer
    (rank 1's Engine becomes the worker and exits 0)."""
    prompt = "Hello, world! How are you"
    want = make_engine(tiny_model_dir).generate(prompt, {"max_new_tokens": 6, "temperature": 0})["text"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "radixserve.cli",
            "generate",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--tp",
            "2",
            "--max-new-tokens",
            "6",
            prompt,
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == want + "\n"


def test_gpu_placement_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --dp 2 --tp 2` gives replica i GPUs 2i, 2i+1; rank r of a spawned group uses the r-th GPU after the
    configured one; too few GPUs for --tp is refused before any process starts."""
    from radixserve.router.replicas import replica_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [replica_env(i, 2, "cuda", tp=2)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0,1", "2,3"]
    assert distributed.rank_device(torch.device("cuda", 1), 2) == torch.device("cuda", 3)
    assert distributed.rank_device(torch.device("cpu"), 1) == torch.device("cpu")
    with pytest.raises(ValueError, match="tp=2 needs 2 GPUs from cuda:3, but 4 are visible"):
        distributed.start(2, torch.device("cuda", 3), [])
