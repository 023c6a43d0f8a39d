"""Constrained decoding on the real default model: every case of tests/data/structured_cases.json (JSON schemas
with nested objects, arrays, enums, bounded numbers, optional fields, string patterns; and regexes), greedy and
sampled, all in one batch, gives output that parses and validates, 100%; and unconstrained greedy requests in that
batch get exactly the tokens they get alone."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from real_model import real_engine, real_model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
CASES = json.loads((Path(__file__).parent / "data" / "structured_cases.json").read_text())
MAX_NEW = 96  # every schema bounds its strings and arrays, so a valid output always fits


def _prompt(eng: Any, case: dict) -> list[int]:
    hint = "Reply with JSON only." if case["kind"] == "json_schema" else ""
    if case["kind"] == "regex":
        return eng.encode(case["prompt"] + " ")
    return eng.apply_chat_template([{"role": "user", "content": f"{case['prompt']} {hint}"}])


def _valid(case: dict, text: str) -> bool:
    if case["kind"] == "regex":
        return re.fullmatch(case["grammar"], text) is not None
    return jsonschema_rs.validator_for(case["grammar"]).is_valid(json.loads(text))


def test_every_constrained_output_validates_and_shares_the_batch_harmlessly(real_engine: Any) -> None:  # noqa: F811
    assert len(CASES) >= 30
    free_prompts = [real_engine.encode("def fibonacci(n):"), real_engine.encode("The capital of France is")]
    free = {"max_new_tokens": 16, "temperature": 0.0}
    alone = [real_engine.generate(input_ids=ids, sampling_params=free)["output_ids"] for ids in free_prompts]

    ids, params, which = [], [], []
    for case in CASES:
        for mode, extra in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.8, "seed": 7})):
            ids.append(_prompt(real_engine, case))
            params.append({"max_new_tokens": MAX_NEW, case["kind"]: case["grammar"], **extra})
            which.append((case, mode))
    ids += free_prompts
    params += [free, free]
    outs = real_engine.generate(input_ids=ids, sampling_params=params)

    bad = []
    for (case, mode), out in zip(which, outs):
        try:
            ok = out["meta_info"]["finish_reason"]["type"] == "stop" and _valid(case, out["text"])
        except ValueError:
            ok = False
        if not ok:
            bad.append((case["name"], mode, out["text"], out["meta_info"]["finish_reason"]))
    assert not bad, bad
    assert [o["output_ids"] for o in outs[-2:]] == alone
    assert real_engine.scheduler.stats.forced_tokens > 0  # jump-forward ran
