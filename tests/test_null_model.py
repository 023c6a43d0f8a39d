"""The null model (radixserve/model/null.py): the engine's whole host path with no layer, for benchmarks/loop_overhead.py."""

from __future__ import annotations

from pathlib import Path

from radixserve.model.null import NULL_TOP_TOKEN


def test_null_model_runs_the_host_path_with_fixed_logits(make_engine, tiny_model_dir: Path) -> None:
    eng = make_engine(tiny_model_dir, null_model=True, page_size=4)
    outs = eng.generate(
        input_ids=[[5, 6, 7, 8, 9], [5, 6, 7, 10]],
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    for out in outs:  # greedy over the same logits at every position
        assert out["output_ids"] == [NULL_TOP_TOKEN] * 6
        assert len(out["meta_info"]["output_token_logprobs"]) == 6
    constrained = eng.generate("x", {"max_new_tokens": 4, "regex": "(ab)+"})
    assert constrained["text"].startswith("ab")  # the grammar masks the fixed logits as it would the model's
    assert eng.cache_stats()["hit_tokens"] > 0  # the scheduler and cache ran as with a model
