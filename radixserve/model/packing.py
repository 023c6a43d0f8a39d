"""oneDNN packing of a loaded model, off the start-up path: done on a background thread, and by a module itself
the first time it runs if the thread has not reached it yet.

Why: packing (bf16 weights reordered into oneDNN's blocked layout) is redone
at every load, since the layout cannot be saved, and it was the largest cost of a start once the weights come
mapped from a prepared file (radixserve/model/prepared.py): ~1 s on an idle 2-core machine, ~5 s on a loaded one.
Deferred, it overlaps the rest of the start (tokenizer, scheduler, the HTTP server) and the time until the first
request. Outputs do not depend on when it finishes: a forward pre-hook on every module that has a packing job
packs it (or waits for the thread's packing of it) before its first forward, so every forward sees the packed
weights, exactly as with packing at load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch import nn


class DeferredPacking:
    """The packing jobs of one model: `start()` runs them on a thread; each module packs itself if still due."""

    def __init__(self, jobs: list[tuple[nn.Module, Callable[[], None]]]) -> None:
        self._jobs = jobs
        self._locks = [threading.Lock() for _ in jobs]
        self._done = [False] * len(jobs)
        self._index = {id(module): i for i, (module, _) in enumerate(jobs)}
        self._hooks = [module.register_forward_pre_hook(self._before_forward) for module, _ in jobs]

    def _run(self, i: int) -> None:
        with self._locks[i]:
            if self._done[i]:
                return
            self._jobs[i][1]()
            self._done[i] = True
            self._hooks[i].remove()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._run(self._index[id(module)])

    def _run_all(self) -> None:
        try:
            for i in range(len(self._jobs)):
                self._run(i)
        except Exception:  # noqa: BLE001 - the module's own forward runs the job again and raises there
            return

    def start(self) -> None:
        # Not a daemon: interpreter exit waits for it rather than tearing torch's threads down under a running op.
        threading.Thread(target=self._run_all, name="radixserve-packing").start()

    def wait(self) -> None:
        """Finish every job in the calling thread (the ones the thread is doing are waited for)."""
        for i in range(len(self._jobs)):
            self._run(i)

    @property
    def pending(self) -> int:
        return self._done.count(False)
