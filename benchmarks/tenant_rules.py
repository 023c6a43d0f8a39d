"""Which of the two fair-share rules of issue 21's follow-up matter (radixserve/scheduler/fairness.py `room`,
admission.py `_may_join`): four engines, both rules, each alone, neither, under the same flood, interleaved round
after round; per engine the work the quiet tenant's requests waited for before their first token (StepLog).

    python -m benchmarks.tenant_rules [--flood-unique 1024] [--duration 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.random_model import make_random_model
from benchmarks.tenants import SYSTEM, Load, StepLog, scenario, slowest_tenth, whole_steps
from radixserve import Engine

# variant -> the rules it turns off (whole_steps' room, join)
VARIANTS = {"both": (False, False), "room only": (False, True), "join only": (True, False), "neither": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood-unique", type=int, default=1024, help="tokens of each flood prompt after the system one")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = make_random_model(
        Path(tempfile.mkdtemp()) / "m", layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab=512
    )
    settings = dict(model=model, dtype="float32", page_size=16, max_total_tokens=32768, max_running_requests=16)
    engines = {v: Engine(**settings) for v in VARIANTS}
    for v, eng in engines.items():
        whole_steps(eng, *VARIANTS[v])
        eng.generate(input_ids=SYSTEM + [1], sampling_params={"max_new_tokens": 2})
    logs = {v: StepLog(eng) for v, eng in engines.items()}
    works: dict[str, list[tuple[int, int, int]]] = {v: [] for v in VARIANTS}
    for rnd in range(args.rounds):
        for v, eng in engines.items():

            def quiet(i: int, rnd: int = rnd) -> list[int]:
                return random.Random(rnd * 1000 + 7 + i).choices(range(3, 512), k=128)

            def flood(i: int) -> list[int]:
                return SYSTEM + [(i * 37 + k) % 500 + 3 for k in range(args.flood_unique)]

            measured = Load(eng, 1.0, "quiet", quiet, 16, give_up=30, steps=logs[v])
            asyncio.run(scenario(measured, Load(eng, 10.0, "flood", flood, 32), args.duration, rnd))
            works[v] += measured.works()
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"round {rnd + 1} {v}: retractions so far {eng.metrics()['num_retractions']}, load {load}", flush=True
            )
    print("\n| rules | work p50 / p95 | slowest 10%: the flood's prefill / decodes / the rest |\n|---|---|---|")
    for v, ws in works.items():
        total = [w[0] for w in ws]
        split = " / ".join(f"{x:.0f}" for x in slowest_tenth(ws))
        print(f"| {v} | {np.percentile(total, 50):.0f} / {np.percentile(total, 95):.0f} | {split} |")
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    main()
