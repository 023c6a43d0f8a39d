"""One scenario in the libraries' interpreter: `python -m benchmarks.agent_suite.worker LIBRARY SCENARIO BASE_URL`
prints its Outcome as one JSON line; `--list` prints every (library, scenario) pair. A process per scenario, so
one library's global state (a default client, tracing) cannot leak into the next."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import warnings

from benchmarks.agent_suite.outcome import Kind, Outcome, classify
from benchmarks.agent_suite.scenarios import REGISTRY

# The library programs, one module each; importing one registers its scenarios.
PROGRAMS = ("openai_sdk", "agents_sdk", "langchain_chat", "langgraph_agent", "pydantic_ai_agent", "instructor_extract")


def load() -> None:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    warnings.filterwarnings("ignore")  # deprecation notices from the libraries are not the suite's output
    logging.disable(logging.WARNING)
    for name in PROGRAMS:
        importlib.import_module(f"benchmarks.agent_suite.{name}")


def run(library: str, name: str, url: str) -> Outcome:
    fn = REGISTRY[library][name]
    start = time.monotonic()
    try:
        fn(url)
    except Exception as exc:  # noqa: BLE001  (every failure is an outcome to classify, not a crash)
        kind, detail = classify(exc)
        return Outcome(library, name, kind, detail, time.monotonic() - start)
    return Outcome(library, name, Kind.PASSED, "", time.monotonic() - start)


def main(argv: list[str]) -> None:
    load()
    if argv == ["--list"]:
        print(json.dumps([[lib, name] for lib, names in REGISTRY.items() for name in names]))
        return
    library, name, url = argv
    print(run(library, name, url).to_json())


if __name__ == "__main__":
    main(sys.argv[1:])
