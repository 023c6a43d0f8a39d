"""Makes the programs of one run_batch compute their common prompt prefix once.

Programs sent together all miss the cache for the text they share (a system prompt, few-shot examples): the cache
holds a prefix only after one request has computed it. So the first backend call of each program in the batch's
first wave waits at this gate until every program of the wave has made its first call (or finished without one);
then the longest common prefix of those prompts is prefilled once and the gate opens for good. A timeout keeps a
program that is slow to reach its first call from holding the others for long.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class PrefixGate:
    def __init__(self, prefill: Callable[[str], None], expected: int, timeout_s: float = 10.0) -> None:
        """`prefill(text)` computes text into the cache; `expected` programs must arrive (or leave) to open the gate."""
        self._prefill = prefill
        self._expected = expected
        self._timeout_s = timeout_s
        self._prompts: list[str] = []
        self._count = 0
        self._lock = threading.Lock()
        self._open = threading.Event()
        self.prefill_error: Exception | None = None
        if expected <= 1:
            self._open.set()

    def ticket(self) -> "GateTicket":
        """One per program: its first arrival (or its leaving) counts toward opening the gate."""
        return GateTicket(self)

    def _check_in(self, prompt: str | None) -> None:
        with self._lock:
            if self._open.is_set():
                return
            if prompt is not None:
                self._prompts.append(prompt)
            self._count += 1
            last = self._count >= self._expected
        if last:
            self._release()
        elif prompt is not None and not self._open.wait(self._timeout_s):
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._open.is_set():
                return
            prompts = list(self._prompts)
        common = os.path.commonprefix(prompts) if len(prompts) > 1 else ""
        try:
            if common:
                self._prefill(common)
        except Exception as e:  # a failed prefill only costs cache hits; the programs' own calls report failures
            self.prefill_error = e
        self._open.set()


class GateTicket:
    """A program's pass through the gate, shared by the program's state and its forks."""

    def __init__(self, gate: PrefixGate) -> None:
        self._gate = gate
        self._used = False
        self._lock = threading.Lock()

    def _take(self) -> bool:
        with self._lock:
            first = not self._used
            self._used = True
            return first

    def arrive(self, prompt: str) -> None:
        """Called before each backend call; the program's first call waits here until the gate opens."""
        if self._take():
            self._gate._check_in(prompt)

    def leave(self) -> None:
        """The program finished; if it never called the backend it stops holding the gate."""
        if self._take():
            self._gate._check_in(None)
