"""The sampler's time a decode step in the Engine, at temperature 0 (the publisher's repetition penalty applies),
temperature 0 without it, and the publisher's settings (no sampling fields), with each request's tok/s.

One request of 30 random prompt ids, 128 tokens, speculation off, after the GGUF's huge-page move has ended; each
setting twice. `sample_ids` (radixserve/sampling/sampler.py) is timed by wrapping it where the runner calls it.
To compare a build, put its checkout first on PYTHONPATH (RESULTS.md, issue 38 session 28):

    .venv/bin/python -m benchmarks.sampler_cost
    PYTHONPATH=/tmp/before .venv/bin/python -m benchmarks.sampler_cost
"""

from __future__ import annotations

import random
import time
from typing import Any

import radixserve
import radixserve.model.runner as runner_mod
from radixserve import Engine

SETTINGS = (
    ("temperature 0", {"temperature": 0}),
    ("temperature 0, repetition_penalty 1.0", {"temperature": 0, "repetition_penalty": 1.0}),
    ("publisher settings", {"seed": 1}),
)


def main() -> None:
    spent = [0.0, 0]
    sample_ids = runner_mod.sample_ids

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return sample_ids(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += 1

    runner_mod.sample_ids = timed
    with Engine(speculative="off", max_total_tokens=4096) as eng:
        mover = getattr(eng.runner.model, "huge_pages", None)
        if mover is not None:
            mover.join()
        rng = random.Random(0)
        ids = [rng.randrange(1000, 20000) for _ in range(30)]
        eng.generate(input_ids=ids, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": 4})
        print(f"radixserve from {radixserve.__file__}")
        print("| setting | sample_ids us a step | tok/s |\n|---|---|---|")
        for name, params in SETTINGS * 2:
            spent[:] = [0.0, 0]
            t = time.perf_counter()
            eng.generate(input_ids=ids, sampling_params={**params, "ignore_eos": True, "max_new_tokens": 128})
            rate = 128 / (time.perf_counter() - t)
            print(f"| {name} | {spent[0] / spent[1] * 1e6:.0f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
