"""Saved runs side by side: `python -m benchmarks.agent_suite.tables radixserve=A.jsonl llama-server=B.jsonl`
prints, per library, each run's passed / model failures / server errors / timeouts, then every scenario's outcome
in each run (the runs' `--out` files)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from benchmarks.agent_suite.outcome import Kind, Outcome


def load(path: Path) -> list[Outcome]:
    return [Outcome.from_json(line) for line in path.read_text().splitlines() if line.strip()]


def side_by_side(runs: dict[str, list[Outcome]]) -> str:
    """Per library (in the first run's order), `passed / model / server / timeout` of each run."""
    names = list(runs)
    libs = list(dict.fromkeys(o.library for o in runs[names[0]]))
    rows = ["| library | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def cell(outs: list[Outcome]) -> str:
        c = Counter(o.kind for o in outs)
        return f"**{c[Kind.PASSED]}**/{len(outs)} ({c[Kind.MODEL]} / {c[Kind.SERVER]} / {c[Kind.TIMEOUT]})"

    for lib in [*libs, None]:
        cells = [cell([o for o in runs[n] if lib is None or o.library == lib]) for n in names]
        rows.append(f"| {lib or 'all'} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def per_scenario(runs: dict[str, list[Outcome]]) -> str:
    names = list(runs)
    by = {n: {(o.library, o.scenario): o for o in outs} for n, outs in runs.items()}
    rows = ["| scenario | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in by[names[0]]:
        cells = []
        for n in names:
            o = by[n].get(key)
            cells.append("-" if o is None else o.kind.value + (f": {o.detail[:90]}" if o.detail else ""))
        rows.append(f"| {key[0]}/{key[1]} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    runs = {arg.split("=", 1)[0]: load(Path(arg.split("=", 1)[1])) for arg in argv}
    print(side_by_side(runs))
    print()
    print(per_scenario(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
