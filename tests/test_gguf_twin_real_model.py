"""Q5_K on the real default model: its Q4_K tensors (12 of the 24 `ffn_down`) re-stored as Q5_K with the same
weights (benchmarks/gguf_twin.py: codes doubled, d halved, the fifth bits in use). Our Q5_K kernels must then give
the original's numbers bit for bit: each such linear at every row count, and the engine's greedy answers with their
logprobs, through the server's own load path for a GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.gguf_twin import write_twin
from engine_checks import engine_left_at_rest
from radixserve.model.loader import load_model
from radixserve.model.resolve import resolve_model
from real_model import real_gguf, real_model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = ["def quicksort(xs):", "The three laws of thermodynamics are", "SELECT name, count(*) FROM"]


@pytest.fixture(scope="module")
def twin(real_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return write_twin(real_gguf, tmp_path_factory.mktemp("twin") / "q5k-twin.gguf")


def test_q5_k_linears_equal_the_q4_k_ones(real_model_dir: Path, twin: Path, tmp_path: Path) -> None:  # noqa: F811
    folder = resolve_model(twin, cache_dir=tmp_path / "cache", progress=False)
    _, ours = load_model(folder, torch.float32, quantization="gguf")
    _, base = load_model(real_model_dir, torch.float32, quantization="gguf")
    layers = [i for i, layer in enumerate(ours.layers) if layer.mlp.down_proj.parts[0].type == T.Q5_K]
    assert len(layers) == 12
    torch.manual_seed(0)
    x = torch.randn(40, ours.layers[0].mlp.down_proj.in_features)
    for i in layers:
        assert base.layers[i].mlp.down_proj.parts[0].type == T.Q4_K
        q5, q4 = ours.layers[i].mlp.down_proj, base.layers[i].mlp.down_proj
        for rows in (1, 2, 5, 6, 8, 12, 40):  # both AVX2 forms (1-5, 6-8 rows a pass) and a prefill
            assert torch.equal(q5(x[:rows]), q4(x[:rows]))
        assert torch.equal(q5(x[:3].bfloat16()), q4(x[:3].bfloat16()))


def answers(model: Path) -> list[tuple[list[int], list[float]]]:
    # No publisher sampling defaults: the default model's folder has its generation_config.json, a bare GGUF none.
    with engine_left_at_rest(model, max_total_tokens=4096, speculative="off", sampling_defaults="none") as eng:
        outs = eng.generate(prompt=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def test_q5_k_twin_answers_as_the_original(real_model_dir: Path, twin: Path) -> None:  # noqa: F811
    ours = answers(twin)
    assert ours == answers(real_model_dir)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids, _ in ours)
