"""Quality of each weight format on the default model, measured against float32 (issue 14):

- perplexity on the first 2,000 tokens of tests/data/perplexity_text.txt (public-domain prose), one prompt with
  `logprob_start_len=0` (every token scored given all before it; the engine prefills it in chunks);
- greedy agreement with float32 over the first 64 tokens of 20 chat prompts (`--prompts 50`: all 50): per prompt, how
  many leading tokens are identical, and how many prompts match for all 64.

A config is `dtype:weights[:kv_cache_dtype]`: `bfloat16:none:int8` keeps bfloat16 weights and stores the KV pages
in int8 (issue 40), so against `bfloat16:none` it isolates the KV format. `--ppl-tokens 4096 --text A B` scores a
longer context from several files, concatenated.

Engines are built one after another (only one in memory). Prints a markdown table with the CPU flags. A config
ending in `+kernel` runs int8's decode kernel at every row count (prefill included), so the perplexity also scores
the kernel's own rounding of activations (its VNNI path from 3 rows on), which a normal prefill does not take.

    .venv/bin/python -m benchmarks.quality [--configs float32:none bfloat16:none bfloat16:int8 bfloat16:int8+kernel]
    .venv/bin/python -m benchmarks.quality --configs bfloat16:none bfloat16:none:int8 --ppl-tokens 4096 \
        --text tests/data/perplexity_text.txt README.md docs/DESIGN.md
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.quant_engine import cpu_flags  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.model import quant as quant_mod  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity_text.txt"
PPL_TOKENS = 2000
AGREE_TOKENS = 64
PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a mutex is in two sentences.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "What does `git rebase -i` do?",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "Explain Big-O notation to a beginner.",
    "Write a JavaScript function that debounces another function.",
    "What is a race condition? Give an example.",
    "How do I read a CSV file with pandas and print the first five rows?",
    "Write a C function that computes the length of a string without strlen.",
    "What are the SOLID principles?",
    "Explain the difference between TCP and UDP.",
    "Write a Rust function that returns the largest element of a slice.",
    "What is a closure in Python?",
    "How does a hash table handle collisions?",
    "Write a regular expression that matches an email address.",
    "Explain what a Dockerfile is and show a minimal one for a Flask app.",
    "What is the difference between `==` and `is` in Python?",
    "Write a Go program that prints the numbers 1 to 10 concurrently.",
    # 30 more (issue 40 asks for 50 prompts); --prompts 20 keeps the earlier tables' set.
    "What is the difference between a list and a tuple in Python?",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Explain what an index does in a relational database.",
    "How do I undo the last git commit but keep the changes?",
    "Write a function in TypeScript that deep-clones a plain object.",
    "What is dependency injection?",
    "Explain how HTTPS protects a request.",
    "Write a Python decorator that retries a function three times on an exception.",
    "What is the difference between a stack and a queue?",
    "Write a C++ class for a fixed-size ring buffer.",
    "How does garbage collection work in Java?",
    "Write a shell script that backs up a folder into a dated tar.gz file.",
    "What is the CAP theorem?",
    "Explain the event loop in JavaScript.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is memoization? Show an example.",
    "Write a SQL query that finds duplicate email addresses in a users table.",
    "Explain what a virtual environment is in Python and how to create one.",
    "What is the difference between unit tests and integration tests?",
    "Write a Java method that sorts an array of integers with quicksort.",
    "How do I make an HTTP GET request in Python with the requests library?",
    "Explain what a deadlock is and how to avoid one.",
    "Write a Kotlin data class for a user with a name and an age.",
    "What is the purpose of a load balancer?",
    "Write a Python script that reads a JSON file and prints its keys.",
    "Explain recursion with a simple example.",
    "What does the `volatile` keyword mean in C?",
    "Write a binary search in Python.",
    "What is the difference between REST and GraphQL?",
    "Explain what a B-tree is used for.",
]


def token_logprobs(eng: Engine, ids: list[int]) -> list[float]:
    """The logprob of every token of `ids` but the first, each scored from those before it (one prefill)."""
    out = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0
    )
    return [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]  # the first token has no context


def perplexity(eng: Engine, ids: list[int]) -> float:
    lps = token_logprobs(eng, ids)
    return math.exp(-sum(lps) / len(lps))


def greedy(eng: Engine, n: int = 20) -> list[list[int]]:
    """Greedy answers of AGREE_TOKENS tokens to the first n PROMPTS."""
    prompts = [eng.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:n]]
    outs = eng.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": AGREE_TOKENS, "temperature": 0, "ignore_eos": True}
    )
    return [o["output_ids"] for o in outs]


def leading_match(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement_row(name: str, ppl: float, ppl_ref: float, outs: list[list[int]], reference: list[list[int]]) -> str:
    """A table row: perplexity against the reference's, and how far each prompt's greedy tokens follow it."""
    lead = [leading_match(o, r) for o, r in zip(outs, reference)]
    return (
        f"| {name} | {ppl:.3f} | {100 * (ppl / ppl_ref - 1):+.2f}% | {sum(lead)}/{AGREE_TOKENS * len(lead)} "
        f"| {sum(n == AGREE_TOKENS for n in lead)}/{len(lead)} | {sorted(lead)[len(lead) // 2]} |"
    )


def agreement_table(first: str, ppl_label: str, ref: str, rows: list[str]) -> str:
    """The table agreement_row's rows go in: `first` names the first column, `ref` the reference row."""
    return "\n".join(
        [
            f"| {first} | perplexity ({ppl_label}) | vs {ref} | leading tokens equal to {ref} | prompts equal for all "
            f"{AGREE_TOKENS} | median leading run |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["float32:none", "bfloat16:none", "bfloat16:int8", "bfloat16:int4"])
    ap.add_argument("--ppl-tokens", type=int, default=PPL_TOKENS)
    ap.add_argument("--text", type=Path, nargs="+", default=[TEXT])
    ap.add_argument("--prompts", type=int, default=20, choices=range(1, len(PROMPTS) + 1), metavar="N")
    a = ap.parse_args()
    text = "\n\n".join(p.read_text() for p in a.text)
    print(cpu_flags())
    rows, reference, ppl_ref = [], None, None
    for conf in a.configs:
        t = time.perf_counter()
        dtype, quant, kv = (conf + ":auto").split(":")[:3]
        kernel_everywhere = quant.endswith("+kernel")
        quant = quant.removesuffix("+kernel")
        with contextlib.ExitStack() as stack:
            if kernel_everywhere:
                rows_before = quant_mod.INT8_KERNEL_ROWS
                quant_mod.INT8_KERNEL_ROWS = 1 << 30
                stack.callback(setattr, quant_mod, "INT8_KERNEL_ROWS", rows_before)
            tokens = max(8192, a.ppl_tokens + 512)
            eng = stack.enter_context(
                Engine(dtype=dtype, quantization=quant, kv_cache_dtype=kv, max_total_tokens=tokens)
            )
            ids = eng.tokenizer.encode(text, add_special_tokens=False)[: a.ppl_tokens]
            if len(ids) < a.ppl_tokens:
                raise SystemExit(f"{a.text} hold {len(ids)} tokens, fewer than {a.ppl_tokens}")
            ppl, outs = perplexity(eng, ids), greedy(eng, a.prompts)
        reference = reference or outs
        ppl_ref = ppl_ref or ppl
        rows.append(agreement_row(conf, ppl, ppl_ref, outs, reference))
        print(f"{conf}: {time.perf_counter() - t:.0f} s", flush=True)
    print(agreement_table("dtype:quantization[:kv]", f"{a.ppl_tokens} tokens", a.configs[0], rows))


if __name__ == "__main__":
    main()
