"""The DSL fork workload: examples/branch_solve_merge.py run on radixserve, recorded, and replayed on every engine.

The program runs once per task through the DSL's HTTP backend wrapped in a recorder, which keeps each model call
(prompt, token limit, start and end). Calls of one program that overlap in time were sent together (the fork's
branches); a call that starts after another ended depended on it. That gives the stages the replay client sends,
so llama.cpp and transformers get the very prompts radixserve got, in the same order and parallelism.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.compare.client import Session, Step
from benchmarks.compare.engines import REPO

sys.path[:0] = [str(REPO), str(REPO / "examples")]

import frontend_dsl as sgl  # noqa: E402
from frontend_dsl.backends.base import Backend  # noqa: E402

EXTRA_TASKS = [
    """Review this Python function.

def dedupe(items):
    seen = []
    out = []
    for x in items:
        if x not in seen:
            seen.append(x)
            out.append(x)
    return out
""",
    """Review this Python function.

def read_config(path):
    f = open(path)
    data = {}
    for line in f.readlines():
        key, value = line.split("=")
        data[key] = value
    return data
""",
    """Review this Python function.

def percentile(values, p):
    values.sort()
    k = int(len(values) * p / 100)
    return values[k]
""",
]


@dataclass
class Call:
    prompt: str | list[int]
    max_new_tokens: int
    start: float
    end: float


class RecordingBackend(Backend):
    """Passes every call to `inner` and records the generation calls (prompt, token limit, times)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[Call] = []
        self.lock = threading.Lock()

    def record(self, prompts: list[str | list[int]], params: dict[str, Any] | None, start: float) -> None:
        end = time.perf_counter()
        with self.lock:
            for p in prompts:
                self.calls.append(Call(p, int((params or {}).get("max_new_tokens", 16)), start, end))

    def generate(
        self,
        *,
        text: str | None = None,
        input_ids: list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        **kw: Any,
    ) -> Any:
        start = time.perf_counter()
        out = self.inner.generate(text=text, input_ids=input_ids, sampling_params=sampling_params, **kw)
        self.record([text] if text is not None else list(input_ids or []), sampling_params, start)
        return out

    def generate_stream(self, text: str, sampling_params: dict[str, Any], **kw: Any) -> Iterator[dict[str, Any]]:
        start = time.perf_counter()
        yield from self.inner.generate_stream(text, sampling_params, **kw)
        self.record([text], sampling_params, start)

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.inner.render_chat(messages)

    def cache_stats(self) -> dict[str, Any]:
        return self.inner.cache_stats()

    def get_server_info(self) -> dict[str, Any]:
        return self.inner.get_server_info()

    def flush_cache(self) -> bool:
        return self.inner.flush_cache()


def stages(calls: list[Call]) -> list[list[Call]]:
    """Group one program's calls: a call joins the current stage unless it started after one of its calls ended."""
    out: list[list[Call]] = []
    for c in sorted(calls, key=lambda c: c.start):
        if out and all(c.start < prev.end for prev in out[-1]):
            out[-1].append(c)
        else:
            out.append([c])
    return out


def run_programs(url: str, tasks: int) -> tuple[list[list[Call]], float, dict[str, Any]]:
    """Run branch-solve-merge on `tasks` tasks, one after another, against the radixserve server at url.
    Returns each program's calls, the total wall time and the cache stats over the run."""
    from branch_solve_merge import CRITERIA, TASK, branch_solve_merge

    backend = RecordingBackend(sgl.RuntimeEndpoint(url, timeout_s=3600))
    before = backend.cache_stats()
    programs = []
    t0 = time.perf_counter()
    for task in ([TASK] + EXTRA_TASKS)[:tasks]:
        n = len(backend.calls)
        branch_solve_merge.run(task=task, criteria=CRITERIA, backend=backend, temperature=0)
        programs.append(backend.calls[n:])
    wall = time.perf_counter() - t0
    after = backend.cache_stats()
    hit, prompt = after["hit_tokens"] - before["hit_tokens"], after["prompt_tokens"] - before["prompt_tokens"]
    return programs, wall, {"hit_tokens": hit, "prompt_tokens": prompt, "hit_rate": hit / prompt if prompt else 0.0}


def sessions(programs: list[list[Call]]) -> list[Session]:
    """One replay session per program, its stages as recorded (prefill-only calls keep max_tokens=0)."""
    out = []
    for calls in programs:
        groups = stages(calls)
        out.append(
            Session(
                [
                    [Step(c.max_new_tokens, prompt=c.prompt, tag=_tag(c, k, len(groups), len(g))) for c in g]
                    for k, g in enumerate(groups)
                ]
            )
        )
    return out


def _tag(call: Call, stage: int, n_stages: int, width: int) -> str:
    if call.max_new_tokens == 0:
        return "prefill"
    if width > 1:
        return "branch"
    return "merge" if stage == n_stages - 1 else "gen"
