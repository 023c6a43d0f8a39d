"""What the repetition penalty costs a decode step, with the request's SeenIds against a rebuild every step.

    python -m benchmarks.penalty_cost [--prompt-lens 30,2000,8000] [--rows 1,8] [--steps 200]

The default model's publisher asks for repetition_penalty 1.1 (radixserve/model/sampling_defaults.py), so every
request that leaves it unset, the benchmarks' temperature-0 requests included, pays it at every step. Each row has
a prompt of random ids and grows its output by one random id a step; reported: milliseconds of `apply_penalties`
per step over the vocabulary of the default model (151,936), kept ids (what the engine does) and rebuilt (a set of
prompt + output built per step, as before SeenIds; a verify row still takes that path), each the median of
`--rounds` alternations (the machine is noisy).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from radixserve.sampling.info import SamplingInfo, SeenIds
from radixserve.sampling.penalties import apply_penalties
from radixserve.sampling_params import SamplingParams

VOCAB = 151_936


def per_step_ms(prompt_len: int, rows: int, steps: int, kept: bool) -> float:
    rng = random.Random(0)
    infos = []
    for _ in range(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, repetition_penalty=1.1)
        infos.append(SamplingInfo(params, None, [], prompt, seen=SeenIds(prompt) if kept else None))
    logits = torch.randn(rows, VOCAB)
    for _ in range(5):
        apply_penalties(logits, infos)
    start = time.perf_counter()
    for _ in range(steps):
        for info in infos:
            info.output_ids.append(rng.randrange(VOCAB))
        apply_penalties(logits, infos)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="30,2000,8000")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two ways; the median is reported")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the sampler runs on the engine's loop thread
    print(f"{'prompt':>7} {'rows':>4} {'kept ms':>8} {'rebuilt ms':>10}")
    for prompt_len in (int(x) for x in args.prompt_lens.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            runs = [
                [per_step_ms(prompt_len, rows, args.steps, kept) for kept in (True, False)] for _ in range(args.rounds)
            ]
            kept, rebuilt = (statistics.median(way) for way in zip(*runs))
            print(f"{prompt_len:>7} {rows:>4} {kept:>8.3f} {rebuilt:>10.3f}")


if __name__ == "__main__":
    main()
