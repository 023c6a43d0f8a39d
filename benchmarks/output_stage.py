"""The per-token path before and after the output stage (issue 13): two source trees, A and B, run in turn.

Each round starts a fresh interpreter per tree (A, B, A, B, ...) with PYTHONPATH at that tree, which measures:
- the default model (bf16, Engine defaults): decode tokens/s of 1 and of 8 streams (distinct 64-token prompts cut
  from this file's tokens, 32 greedy tokens each, ignore_eos), as benchmarks/cpu_speed.py counts them (tokens after the first / time from the
  last first token to the last finish, from meta_info), and the wall time of each call;
- the tiny test model (qwen2, float32; tests/tiny_models.py): 32 requests x 192 greedy tokens at once, plain, with
  stop strings that never match (so each token is checked), and as 32 streams: tokens/s of wall time;
- for each, CPU time per token of the whole process (all threads: less sensitive to other jobs than wall time) and
  of the engine loop's thread alone (time.thread_time, read on the loop through Engine.loop.call).
Each figure is the best of 2 tries in its interpreter (the machine is shared); the table gives medians over rounds.
It also keeps every greedy output (ids and text, and the stop-string cuts of the tiny model's answers, and of the
other tiny architectures: llama, llama3, qwen3, mistral) and checks at the end that A and B gave the same ones. Prints medians per tree and B/A.

    .venv/bin/python -m benchmarks.output_stage --a /tmp/base --b . [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TESTS = HERE.parent.parent / "tests"


def _decode_rate(outs: list[dict[str, Any]]) -> float:
    tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
    first = max(o["meta_info"]["ttft"] for o in outs)
    last = max(o["meta_info"]["e2e_latency"] for o in outs)
    return tokens / (last - first)


def child(tiny_dir: Path) -> dict[str, Any]:
    """Run in a fresh interpreter whose `radixserve` is the tree under test; each figure is the best of 2 tries."""
    from radixserve import Engine

    res: dict[str, Any] = {"figures": {}, "outputs": {}}
    fig, outs = res["figures"], res["outputs"]

    def best(key: str, value: float, higher: bool = True) -> None:
        old = fig.get(key)
        fig[key] = value if old is None else (max if higher else min)(old, value)

    def measure(eng: Any, key: str, tokens: int, fn: Any) -> Any:
        """Run fn on a flushed cache: tokens/s of wall time, and CPU per token of all threads and of the loop's."""
        eng.flush_cache()
        loop0, cpu0, t0 = eng.loop.call(time.thread_time), time.process_time(), time.perf_counter()
        out = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        loop = eng.loop.call(time.thread_time) - loop0
        best(f"{key}: tok/s", tokens / wall)
        best(f"{key}: CPU us/token, all threads", cpu / tokens * 1e6, higher=False)
        best(f"{key}: CPU us/token, loop thread", loop / tokens * 1e6, higher=False)
        return out

    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with Engine(dtype="bfloat16") as eng:
        source = eng.encode(HERE.read_text())  # this file: the same prompts for both trees
        prompts = [source[64 * i : 64 * (i + 1)] for i in range(8)]
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2})  # warm-up
        for _ in range(2):
            for n in (1, 8):
                got = measure(
                    eng,
                    f"default, {n} stream(s)",
                    32 * n,
                    lambda: eng.generate(input_ids=prompts[:n], sampling_params=greedy),
                )
                best(f"default, {n} stream(s): decode tok/s (cpu_speed.py's count)", _decode_rate(got))
                outs[f"default x{n}"] = [(o["output_ids"], o["text"]) for o in got]
    with Engine(model=tiny_dir, dtype="float32") as eng:
        new = 192
        prompts = [[(7 * i + 3 * k) % 500 + 3 for k in range(24 + i % 8)] for i in range(32)]
        p64 = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        nomatch = {**p64, "stop": ["\u2603never\u2603", "zzqzzq"]}
        eng.generate(input_ids=prompts, sampling_params=p64)  # warm-up, at the batch's shapes

        async def streams() -> list[list[int]]:
            async def one(ids: list[int]) -> list[int]:
                chunks = eng.async_generate(input_ids=ids, sampling_params=p64, stream=True)
                return [t async for c in chunks for t in c["output_ids"]]

            return await asyncio.gather(*(one(p) for p in prompts))

        n = 32 * new
        for _ in range(2):
            got = measure(eng, "tiny 32 requests", n, lambda: eng.generate(input_ids=prompts, sampling_params=p64))
            outs["tiny"] = [(o["output_ids"], o["text"]) for o in got]
            got = measure(
                eng,
                "tiny 32 requests, stop strings",
                n,
                lambda: eng.generate(input_ids=prompts, sampling_params=nomatch),
            )
            outs["tiny nomatch"] = [(o["output_ids"], o["text"]) for o in got]
            outs["tiny streams"] = measure(eng, "tiny 32 streams", n, lambda: asyncio.run(streams()))
        # Stop strings that do match: a piece of each answer's text (cut where it was cut before)
        stops = [{**p64, "stop": [t[len(t) // 2 : len(t) // 2 + 3]]} for _, t in outs["tiny"]]
        got = eng.generate(input_ids=prompts, sampling_params=stops)
        outs["tiny stop"] = [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in got]
    for arch_dir in sorted(tiny_dir.parent.glob(f"{tiny_dir.name}-*")):  # every other tiny architecture: outputs only
        with Engine(model=arch_dir, dtype="float32") as eng:
            got = eng.generate(input_ids=prompts[:8], sampling_params={**p64, "max_new_tokens": 24})
            stops = [{**p64, "stop": [o["text"][10:13]]} for o in got]
            cut = eng.generate(input_ids=prompts[:8], sampling_params=stops)
            outs[arch_dir.name.rsplit("-", 1)[1]] = [
                (o["output_ids"], o["text"], c["output_ids"], c["text"], c["meta_info"]["finish_reason"])
                for o, c in zip(got, cut)
            ]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, required=True, help="source tree A (e.g. main's commit)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return
    sys.path.insert(0, str(TESTS))
    from tiny_models import make_tiny_checkpoint
    from tiny_tokenizer import build_tokenizer

    tiny = Path(tempfile.mkdtemp(prefix="radixserve-tiny-")) / "tiny"
    for arch in ("qwen2", "llama", "llama3", "qwen3", "mistral"):
        out = tiny if arch == "qwen2" else tiny.parent / f"tiny-{arch}"
        make_tiny_checkpoint(out, arch)
        build_tokenizer(out)
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_WAIT_POLICY": "PASSIVE"}
            cmd = [sys.executable, str(HERE), "--a", "-", "--b", "-", "--child", str(tiny)]
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
            runs[name].append(json.loads(line[7:]))
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} {name}: {runs[name][-1]['figures']}  (load {loads[-1]:.2f})", flush=True)
    same = all(x["outputs"] == runs["A"][0]["outputs"] for x in runs["A"] + runs["B"])
    print(f"\nload average (1 min) before/after each run: {', '.join(f'{x:.2f}' for x in loads)}")
    print(f"greedy outputs identical across A and B and every round: {same}\n")
    print("| measure | A (median) | B (median) | B / A |\n|---|---|---|---|")
    for key in runs["A"][0]["figures"]:
        a = statistics.median(x["figures"][key] for x in runs["A"])
        b = statistics.median(x["figures"][key] for x in runs["B"])
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
