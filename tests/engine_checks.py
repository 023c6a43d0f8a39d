"""Checks every engine test ends with (DESIGN.md rule 2): at rest, nothing leaked, a flush frees every page."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def wait_idle(engine: Any, timeout: float = 30.0) -> None:
    """Block until nothing runs or waits (aborts reach the engine loop asynchronously)."""
    deadline = time.monotonic() + timeout
    # The last outputs reach their callers from the output stage after the loop is idle, and each gives back its
    # place in the queue count (Engine._inflight) then: a caller that submits next must not find it still taken.
    while (m := engine.metrics())["num_running"] or m["num_waiting"] or getattr(engine, "_inflight", 0):
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.02)


def assert_at_rest(engine: Any) -> None:
    """Idle, invariants hold, and flushing the cache returns every page to the free list."""
    wait_idle(engine)
    engine.check_invariants()
    assert engine.flush_cache(), "requests still running"
    stats = engine.cache_stats()
    assert stats["free_pages"] == stats["total_pages"], stats


@contextmanager
def engine_left_at_rest(model: Path, **kwargs: Any) -> Iterator[Any]:
    """An Engine for a module-scoped fixture: checked at rest (`assert_at_rest`) after its last test, then shut down."""
    from radixserve import Engine

    eng = Engine(model=model, **kwargs)
    try:
        yield eng
        assert_at_rest(eng)
    finally:
        eng.shutdown()


async def leave_stream_after(engine: Any, ids: list[int], stop_after: int) -> None:
    """Stream a request and leave after `stop_after` chunks: leaving the stream early aborts the request."""
    it = engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 20, "ignore_eos": True}, stream=True)
    n = 0
    async for _ in it:
        n += 1
        if n >= stop_after:
            break
    await it.aclose()


async def abort_after(engine: Any, ids: list[int], delay: float, rid: str) -> dict[str, Any]:
    """Start a request, abort it by rid after `delay` seconds (queued, mid-prefill or mid-decode by then), return
    what it answered."""
    task = asyncio.ensure_future(engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 30}, rid=rid))
    await asyncio.sleep(delay)
    engine.abort(rid)
    return await task
