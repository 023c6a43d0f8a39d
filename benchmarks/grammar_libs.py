"""llguidance vs xgrammar on the CPU, for the default model's vocabulary (151,936 ids): one-off tokenizer setup,
JSON-schema compile time, and the per-token cost of a step's grammar work (fill the bitmask, apply it to a logits
row, accept the token) along a valid 45-token JSON document. Needs both installed (`pip install xgrammar`; only
llguidance is a dependency of radixserve).

    .venv/bin/python -m benchmarks.grammar_libs [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.model.resolve import resolve_model
from radixserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "address": {
            "type": "object",
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        },
    },
}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"], "address": {"city": "London", "zip": "12345"}}


def timed(fn):  # noqa: ANN001, ANN201
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def walk(ids: list[int], step) -> list[float]:  # noqa: ANN001
    times = []
    for i in ids:
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    tok = Tokenizer.from_dir(resolve_model(a.model))
    vocab = 151936 if tok.vocab_size <= 151936 else tok.vocab_size
    eos = sorted(tok.eos_token_ids)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False) + [eos[0]]
    logits = torch.randn(1, vocab)
    rows = []

    import llguidance
    import llguidance.torch as llt

    from radixserve.constrained.bitmask import unpack
    from radixserve.constrained.grammar import JSON_OPTIONS

    lltok, setup = timed(lambda: llguidance.LLTokenizer(tok.backend_json(), n_vocab=vocab, eos_token=eos))
    grammar, compile_s = timed(lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS))
    bm = llt.allocate_token_bitmask(1, vocab)
    for rep in range(3):  # the first walk builds llguidance's lazy caches
        m = llguidance.LLMatcher(lltok, grammar)

        def ll_step(i: int) -> None:
            llt.fill_next_token_bitmask(m, bm, 0)
            logits.masked_fill_(~unpack(bm, vocab), float("-inf"))
            assert m.consume_token(i)

        t = walk(ids, ll_step)
        rows.append(("llguidance", rep, setup, compile_s, t))

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos))
    comp = xgr.GrammarCompiler(info, max_threads=1)
    xbm = xgr.allocate_token_bitmask(1, vocab)
    for rep in range(3):
        cg, compile_s = timed(lambda: comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
        xm = xgr.GrammarMatcher(cg)

        def xg_step(i: int) -> None:
            xm.fill_next_token_bitmask(xbm)
            xgr.apply_token_bitmask_inplace(logits, xbm)
            assert xm.accept_token(i)

        rows.append(("xgrammar", rep, setup, compile_s, walk(ids, xg_step)))

    print(f"vocab={vocab} tokens={len(ids)} torch_threads={torch.get_num_threads()}")
    print("| library | walk | tokenizer setup s | schema compile ms | per token ms (mean) | median | max |")
    print("|---|---|---|---|---|---|---|")
    for lib, rep, setup, comp_s, t in rows:
        print(
            f"| {lib} | {rep} | {setup:.2f} | {comp_s * 1e3:.1f} | {statistics.mean(t) * 1e3:.3f} | "
            f"{statistics.median(t) * 1e3:.3f} | {max(t) * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
