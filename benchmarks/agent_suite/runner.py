"""Run every scenario against one server, each in its own process of the libraries' interpreter with a time limit,
a few at a time; the outcomes, and a table per library with the total."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.agent_suite.outcome import Kind, Outcome

REPO = Path(__file__).resolve().parents[2]
WORKER = "benchmarks.agent_suite.worker"


def _env() -> dict[str, str]:
    # The package comes from this checkout; nothing of the project's venv leaks into the libraries' interpreter.
    return {**os.environ, "PYTHONPATH": str(REPO), "OPENAI_AGENTS_DISABLE_TRACING": "1", "OPENAI_API_KEY": "unused"}


def list_scenarios(python: str) -> list[tuple[str, str]]:
    done = subprocess.run([python, "-m", WORKER, "--list"], capture_output=True, text=True, env=_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{python} cannot load the suite:\n{done.stderr[-3000:]}")
    return [(lib, name) for lib, name in json.loads(done.stdout)]


def run_one(python: str, library: str, name: str, url: str, timeout_s: float) -> Outcome:
    start = time.monotonic()
    try:
        done = subprocess.run(
            [python, "-m", WORKER, library, name, url],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=REPO,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Outcome(library, name, Kind.TIMEOUT, f"over {timeout_s:.0f} s", time.monotonic() - start)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:  # the worker itself broke: say so, never count it as passed
        return Outcome(library, name, Kind.SERVER, f"worker exited {done.returncode}: {done.stderr[-300:]}")
    return Outcome.from_json(lines[-1])


def run_suite(
    python: str, url: str, timeout_s: float, jobs: int, only: set[str] | None = None, verbose: bool = True
) -> list[Outcome]:
    """Every scenario (or those whose `library/name` or library is in `only`), `jobs` at a time."""
    todo = [(lib, n) for lib, n in list_scenarios(python) if not only or lib in only or f"{lib}/{n}" in only]

    def one(pair: tuple[str, str]) -> Outcome:
        out = run_one(python, pair[0], pair[1], url, timeout_s)
        if verbose:
            print(f"  {out.library}/{out.scenario}: {out.kind.value} ({out.seconds:.0f} s) {out.detail}", flush=True)
        return out

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, todo))


def table(outcomes: list[Outcome]) -> str:
    """A markdown table: per library, how many passed, failed on the model, hit a server error or timed out."""
    kinds = list(Kind)
    rows = ["| library | " + " | ".join(k.value for k in kinds) + " | total |", "|---" * (len(kinds) + 2) + "|"]
    by_lib: dict[str, Counter] = {}
    for o in outcomes:
        by_lib.setdefault(o.library, Counter())[o.kind] += 1
    total: Counter = Counter(o.kind for o in outcomes)
    for lib, c in [*by_lib.items(), ("**all**", total)]:
        rows.append(f"| {lib} | " + " | ".join(str(c[k]) for k in kinds) + f" | {sum(c.values())} |")
    return "\n".join(rows)


def failures(outcomes: list[Outcome]) -> str:
    return "\n".join(
        f"- {o.library}/{o.scenario}: {o.kind.value}: {o.detail}" for o in outcomes if o.kind is not Kind.PASSED
    )


def save(outcomes: list[Outcome], path: Path) -> None:
    path.write_text("\n".join(o.to_json() for o in outcomes) + "\n")
    print(f"outcomes written to {path}", file=sys.stderr)
