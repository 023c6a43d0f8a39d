"""frontend_dsl workloads with the radix cache on versus off, in one run: wall time and prefill tokens computed.

    python benchmarks/dsl_cache.py [--model PATH] [--workloads rag,tot]

rag: the RAG example (a long shared system prompt, six questions through run_batch).
tot: a tree of thought (question -> 3 plans -> 2 solutions each -> a select verdict per solution), nested forks.
Each mode gets a fresh engine and a warm-up program; outputs must be identical in both modes (greedy decoding).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import frontend_dsl as sgl  # noqa: E402
from rag import QUESTIONS  # noqa: E402
from rag import answer as rag_answer  # noqa: E402


@sgl.function
def tree_of_thought(s, question, plans, solutions):
    s += sgl.system("You are a careful problem solver. Keep every step short.")
    s += sgl.user_begin() + question
    plan_forks = s.fork(plans)
    plan_forks += lambda i: f"\nPropose plan number {i + 1}, in one sentence." + sgl.user_end()
    plan_forks += sgl.assistant(sgl.gen("plan", max_tokens=32, stop="\n"))
    verdicts = []
    for p in plan_forks:
        p += sgl.user("Carry out the plan and give the final answer.")
        sol_forks = p.fork(solutions)
        sol_forks += lambda i: sgl.assistant(f"Attempt {i + 1}: " + sgl.gen("solution", max_tokens=48))
        for f in sol_forks:
            f += sgl.user("Is this attempt correct?")
            f += sgl.assistant(sgl.select("verdict", choices=["Yes, it is correct.", "No, it is wrong."]))
            verdicts.append(f)
    return [(v["solution"], v["verdict"]) for v in verdicts]


def run_rag(backend: sgl.Backend) -> list[Any]:
    states = rag_answer.run_batch([{"question": q} for q in QUESTIONS], backend=backend, temperature=0)
    return [st["answer"] for st in states]


def run_tot(backend: sgl.Backend) -> list[Any]:
    q = (
        "A farmer has 17 sheep. All but 9 run away. He then buys twice as many sheep as he has left. "
        "How many sheep does he have now?"
    )
    return tree_of_thought.run(question=q, plans=3, solutions=2, backend=backend, temperature=0).ret_value


WORKLOADS: dict[str, Callable[[sgl.Backend], list[Any]]] = {"rag": run_rag, "tot": run_tot}


@sgl.function
def warmup(s):
    s += "Warm up:" + sgl.gen("x", max_tokens=4)


def measure(model: str | None, dtype: str, cache: bool, workload: Callable[[sgl.Backend], list[Any]]) -> dict[str, Any]:
    rt = sgl.Runtime(model, dtype=dtype, enable_radix_cache=cache)
    try:
        warmup.run(backend=rt, temperature=0)
        before = rt.metrics()
        t0 = time.perf_counter()
        outputs = workload(rt)
        seconds = time.perf_counter() - t0
        after = rt.metrics()
    finally:
        rt.shutdown()
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    hits = after["cached_tokens_total"] - before["cached_tokens_total"]
    return {
        "seconds": seconds,
        "outputs": outputs,
        "prompt_tokens": prompt,
        "hit_rate": hits / prompt if prompt else 0.0,
        "prefill": after["computed_prefill_tokens_total"] - before["computed_prefill_tokens_total"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: bfloat16; float32 makes on/off bit-identical)")
    p.add_argument("--workloads", default="rag,tot", help="comma-separated: " + ", ".join(WORKLOADS))
    args = p.parse_args()
    print(
        f"# frontend_dsl cache benchmark: model={args.model or 'default'} dtype={args.dtype} machine={platform.machine()} "
        f"python={platform.python_version()}"
    )
    print("| workload | cache | time (s) | prompt tokens | prefill tokens computed | hit rate |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        on = measure(args.model, args.dtype, True, WORKLOADS[name])
        off = measure(args.model, args.dtype, False, WORKLOADS[name])
        for label, r in (("on", on), ("off", off)):
            print(
                f"| {name} | {label} | {r['seconds']:.2f} | {r['prompt_tokens']} | {r['prefill']} | "
                f"{r['hit_rate']:.1%} |"
            )
        print(
            f"| {name} | off/on | {off['seconds'] / on['seconds']:.2f}x | | "
            f"{off['prefill'] / max(on['prefill'], 1):.2f}x | |"
        )
        # bfloat16 sums differ with batch shape (cached prefix vs recomputed), so greedy text may drift; float32 should not
        same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
        print(f"| {name} | outputs equal on/off: {same} of {len(on['outputs'])} | | | | |")


if __name__ == "__main__":
    main()
