"""Constrained decoding in the engine, on the tiny model: outputs match their grammar (greedy, sampled, n > 1, with
logprobs, with overlap), unconstrained rows of the same batch are untouched, jump-forward saves steps, and the
bitmask helpers do what they say."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.constrained.bitmask import StepMasks, unpack
from radixserve.constrained.grammar import GrammarMatcher
from radixserve.errors import ParamError

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["alpha", "beta"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-d]{3}-[0-9]{2}"


def _ok(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"id", "tag"} and 0 <= obj["id"] <= 99 and obj["tag"] in ("alpha", "beta")


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_match_and_free_rows_are_untouched(
    tiny_model_dir: Path, make_engine: Callable, overlap: bool
) -> None:
    eng = make_engine(tiny_model_dir, overlap_schedule=overlap)
    free = {"max_new_tokens": 24, "temperature": 0.0}
    prompts = ["The quick brown fox", "Once upon a time"]
    alone = [eng.generate(p, free)["output_ids"] for p in prompts]
    params = [
        free,
        {"max_new_tokens": 60, "temperature": 0.0, "json_schema": SCHEMA},
        {"max_new_tokens": 60, "temperature": 1.0, "seed": 5, "regex": REGEX},
        free,
        {"max_new_tokens": 60, "temperature": 0.7, "top_p": 0.9, "json_schema": json.dumps(SCHEMA)},
    ]
    outs = eng.generate([prompts[0], "a", "b", prompts[1], "c"], params)
    assert [outs[0]["output_ids"], outs[3]["output_ids"]] == alone
    assert _ok(outs[1]["text"]) and _ok(outs[4]["text"])
    assert re.fullmatch(REGEX, outs[2]["text"])


def test_n_samples_logprobs_and_jump_forward(tiny_model_dir: Path, make_engine: Callable) -> None:
    eng = make_engine(tiny_model_dir)
    outs = eng.generate("x", {"max_new_tokens": 60, "temperature": 1.0, "n": 3, "json_schema": SCHEMA})
    assert len(outs) == 3 and all(_ok(o["text"]) for o in outs)
    # Logprobs: every token is sampled (a forced one would have none), so each has its logprob.
    out = eng.generate("y", {"max_new_tokens": 60, "temperature": 0.0, "json_schema": SCHEMA}, return_logprob=True)
    assert _ok(out["text"]) and len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])

    stats = eng.scheduler.stats
    runs = {}
    for jump in (False, True):
        eng.scheduler.cfg.enable_jump_forward = jump
        steps, forced = stats.steps, stats.forced_tokens
        o = eng.generate("z", {"max_new_tokens": 60, "temperature": 0.0, "json_schema": SCHEMA})
        assert _ok(o["text"])
        runs[jump] = (stats.steps - steps, stats.forced_tokens - forced, o["meta_info"]["completion_tokens"])
    assert runs[False][1] == 0 and runs[True][1] > 0
    assert runs[True][0] < runs[False][0]  # forced tokens cost no step of their own


def test_grammar_errors_name_the_field(tiny_model_dir: Path, make_engine: Callable) -> None:
    eng = make_engine(tiny_model_dir)
    for params, field in [
        ({"regex": "(a"}, "regex"),
        ({"json_schema": {"type": 3}}, "json_schema"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"regex": "a", "json_schema": {}}, "json_schema"),
    ]:
        with pytest.raises(ParamError) as err:
            eng.generate("x", params)
        assert err.value.field == field
    # A grammar that needs more tokens than allowed ends with `length`, not a hang.
    out = eng.generate("x", {"max_new_tokens": 4, "temperature": 0.0, "regex": "[0-9]{50}"})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["text"].isdigit()


def test_compiled_grammars_are_cached_by_text(tiny_model_dir: Path, make_engine: Callable) -> None:
    eng = make_engine(tiny_model_dir)
    # Not built during the engine's start (it holds the GIL for a while): the first compile does.
    assert not eng.grammars._started
    a = eng.grammars.compile("json_schema", SCHEMA)
    assert eng.grammars.compile("json_schema", json.dumps(SCHEMA, indent=2)) is a
    assert eng.grammars.compile("regex", REGEX) is not a


def test_unpack_reads_bits_low_first() -> None:
    words = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)
    bits = unpack(words, 40)
    assert bits[0].nonzero().flatten().tolist() == [0, 2]
    assert bits[1].nonzero().flatten().tolist() == list(range(32)) + [32]
    assert unpack(words, 70).shape == (2, 70) and not unpack(words, 70)[:, 64:].any()


def test_a_step_mixes_stored_first_masks_and_computed_ones(tiny_model_dir: Path, make_engine: Callable) -> None:
    """A request's first mask is copied from its grammar's check; the others are computed; each row is its own."""
    eng = make_engine(tiny_model_dir)
    vocab = eng.model_info()["vocab_size"]

    def allowed(m: GrammarMatcher) -> torch.Tensor:
        return unpack(torch.frombuffer(bytearray(m.ll.compute_bitmask()), dtype=torch.int32)[None], vocab)[0]

    regex, schema = eng.grammars.compile("regex", REGEX), eng.grammars.compile("json_schema", SCHEMA)
    matchers = [eng.grammars.matcher(regex), eng.grammars.matcher(schema), eng.grammars.matcher(schema)]
    assert matchers[1].accept(int(allowed(matchers[1]).nonzero()[0]))
    assert matchers[1].first_mask is None and matchers[0].first_mask is not None
    masks = StepMasks([0, 1, 2], matchers)
    logits = torch.zeros(3, vocab)
    masks.apply(logits)
    for row, m in enumerate(matchers):
        assert torch.equal(logits[row] == 0, allowed(m)), row
