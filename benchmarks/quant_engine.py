"""Engine-level effect of `quantization` on the default model: decode tok/s (1 and 8 streams), prefill TTFT of a
1,000-token prompt, and greedy agreement with float32 on a few chat-like prompts. One process, configs in turn,
CPU flags printed with the figures (this machine is shared: read the ratios).

    .venv/bin/python -m benchmarks.quant_engine [--configs float32:none bfloat16:none bfloat16:int8 float32:int8]
"""
from __future__ import annotations

import argparse
import random

from benchmarks.cpu_speed import Ours
from radixserve import Engine
from radixserve.model import cpu_select

PROMPTS = ["Write a Python function that reverses a linked list.", "Explain what a mutex is in two sentences.",
           "def fibonacci(n):", "SQL query: the ten most recent orders per customer.", "What does `git rebase -i` do?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["float32:none", "bfloat16:none", "bfloat16:int8", "float32:int8"])
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    print(f"cpu={cpu_select.cpu_capability()} bf16_hw={cpu_select.has_bf16_hardware()}")
    print(f"auto -> {cpu_select.choose('auto', 'auto')}")
    rng = random.Random(0)
    reference: list[list[int]] | None = None
    print("| dtype:quant | decode tok/s x1 | decode tok/s x8 (total) | TTFT 1000-token prompt (s) | greedy agreement vs first config |")
    print("|---|---|---|---|---|")
    for conf in a.configs:
        dtype, quant = conf.split(":")
        eng = Engine(dtype=dtype, quantization=quant)
        try:
            ours = Ours(eng)
            vocab = eng.runner.config.vocab_size
            ids = [[rng.randrange(1000, vocab - 1000) for _ in range(64)] for _ in range(8)]
            d1, d8 = ours.decode(ids[:1], a.new_tokens), ours.decode(ids, a.new_tokens)
            ttft = ours.prefill([rng.randrange(1000, vocab - 1000) for _ in range(1000)])
            outs = [eng.generate(prompt=p, sampling_params={"max_new_tokens": a.new_tokens, "temperature": 0,
                                                            "ignore_eos": True})["text"] for p in PROMPTS]
            # Tokens of the answer text (re-encoded: the output dict carries text, not ids).
            outs = [eng.tokenizer.encode(t, add_special_tokens=False) for t in outs]
            if reference is None:
                reference = outs
            agree = sum(next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(o)) for o, r in zip(outs, reference))
            total = sum(len(r) for r in reference)
            print(f"| {conf} | {d1:.1f} | {d8:.1f} | {ttft:.2f} | {agree}/{total} leading tokens |", flush=True)
        finally:
            eng.shutdown()


if __name__ == "__main__":
    main()
