"""Per-key quotas on the generation routes: concurrent requests, requests waiting for a slot, tokens per minute.

A key's request holds one of its `max_concurrent` slots from admission to the end of its response (the last byte of
a stream); past them it waits, unless `max_queued` of its requests wait already: then 429. A key
that used `tokens_per_minute` prompt + completion tokens in the last 60 s gets 429 until enough of them age out
(`Retry-After` says when). Every 429 has an OpenAI-style body. Counters are kept per key name (never the key) and
exported in /metrics.

Tokens are charged as the engine reports them (each chunk's cumulative counts), through a context variable the gate
sets for the request: the handlers and the stream generators run inside the gate's call, so they reach it without
the request being passed down to every helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.auth import principal_of
from radixserve.server.errors import ApiError, error_response
from radixserve.server.tenants import Principal

WINDOW_S = 60.0
# Every route that runs the model (count_tokens and the stored-response reads do not).
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/generate"})
PREFIX = "radixserve_key_"

# The token meter of the request being handled (None outside the gate: nothing is charged).
_METER: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("radixserve_meter", default=None)


def charge(tokens: int) -> None:
    """Count `tokens` (prompt or completion) against the current request's key."""
    meter = _METER.get()
    if meter is not None and tokens > 0:
        meter(tokens)


@dataclass
class KeyUsage:
    """One key name's live counts and totals (kept across key reloads: they are by name)."""

    active: int = 0
    queued: int = 0
    window: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) of the last WINDOW_S
    window_tokens: int = 0
    requests: int = 0
    tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    slot_freed: asyncio.Event | None = None

    def used(self, now: float) -> int:
        while self.window and self.window[0][0] <= now - WINDOW_S:
            self.window_tokens -= self.window.popleft()[1]
        return self.window_tokens

    def add(self, now: float, tokens: int) -> None:
        self.window.append((now, tokens))
        self.window_tokens += tokens
        self.tokens += tokens

    def seconds_until_below(self, limit: int, now: float) -> int:
        """Seconds until the tokens of the last minute drop below `limit`."""
        excess = self.used(now) - limit + 1
        for t, n in self.window:
            excess -= n
            if excess <= 0:
                return max(1, math.ceil(t + WINDOW_S - now))
        return int(WINDOW_S)


def over_quota(message: str, code: str, retry_after: int) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(retry_after)})


class QuotaBook:
    """Every key name's usage; the gate consults it, /metrics reads it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.usage: dict[str, KeyUsage] = {}
        self.clock = clock

    def of(self, name: str) -> KeyUsage:
        return self.usage.setdefault(name, KeyUsage())

    def check_tokens(self, who: Principal) -> None:
        limit = who.limits.tokens_per_minute
        u = self.of(who.name)
        now = self.clock()
        if limit is not None and u.used(now) >= limit:
            self.reject(u, "tokens_per_minute")
            raise over_quota(
                f"key {who.name!r} used {u.used(now)} of its {limit} tokens per minute; retry later",
                "tokens_per_minute_exceeded",
                u.seconds_until_below(limit, now),
            )

    def reject(self, u: KeyUsage, reason: str) -> None:
        u.rejected[reason] = u.rejected.get(reason, 0) + 1

    def meter(self, name: str) -> Callable[[int], None]:
        u = self.of(name)
        return lambda tokens: u.add(self.clock(), tokens)


class KeyCollector(Collector):
    """Per-key-name counters for Prometheus; `only` restricts them to one name (what a user key may read)."""

    def __init__(self, book: QuotaBook, only: str | None = None) -> None:
        self.book = book
        self.only = only

    def collect(self) -> Iterator[Metric]:
        items = [(n, u) for n, u in sorted(self.book.usage.items()) if self.only is None or n == self.only]
        specs = [
            ("requests", "generation requests admitted, by key name", CounterMetricFamily, lambda u: u.requests),
            ("tokens", "prompt + completion tokens charged, by key name", CounterMetricFamily, lambda u: u.tokens),
            (
                "active_requests",
                "requests holding a concurrent slot, by key name",
                GaugeMetricFamily,
                lambda u: u.active,
            ),
            (
                "queued_requests",
                "requests waiting for a concurrent slot, by key name",
                GaugeMetricFamily,
                lambda u: u.queued,
            ),
        ]
        for name, doc, family, value in specs:
            fam = family(PREFIX + name, doc, labels=["key"])
            for key, u in items:
                fam.add_metric([key], value(u))
            yield fam
        rejected = CounterMetricFamily(
            PREFIX + "rejected", "requests refused with 429 by a quota, by key name and quota", labels=["key", "quota"]
        )
        for key, u in items:
            for reason, n in sorted(u.rejected.items()):
                rejected.add_metric([key, reason], n)
        yield rejected


class QuotaGate:
    """ASGI middleware (inside the auth middleware) enforcing a key's limits on the generation routes."""

    def __init__(self, app: ASGIApp, book: QuotaBook) -> None:
        self.app = app
        self.book = book

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_ROUTES or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        who = principal_of(scope)
        try:
            self.book.check_tokens(who)
            receive = await self._slot(who, receive)
        except ApiError as err:
            await error_response(err, scope["path"])(scope, receive, send)
            return
        if receive is None:
            return  # the client left while waiting for a slot
        u = self.book.of(who.name)
        u.requests += 1
        token = _METER.set(self.book.meter(who.name))
        try:
            await self.app(scope, receive, send)
        finally:
            _METER.reset(token)
            u.active -= 1
            if u.slot_freed is not None:
                u.slot_freed.set()

    async def _slot(self, who: Principal, receive: Receive) -> Receive | None:
        """Take a concurrent slot, waiting for one if the key's queue has room (429 if not). Returns the receive
        callable to hand on (messages read while waiting are replayed), or None if the client left meanwhile."""
        u = self.book.of(who.name)
        limit, queue_limit = who.limits.max_concurrent, who.limits.max_queued
        if limit is None or (u.active < limit and u.queued == 0):
            u.active += 1
            return receive
        if queue_limit is not None and u.queued >= queue_limit:
            self.book.reject(u, "max_queued")
            raise over_quota(
                f"key {who.name!r} has {u.active} requests running and {u.queued} waiting "
                f"(max_concurrent {limit}, max_queued {queue_limit}); retry later",
                "too_many_concurrent_requests",
                1,
            )
        buffered: list[Message] = []
        u.queued += 1
        try:
            while u.active >= limit:
                if u.slot_freed is None or u.slot_freed.is_set():
                    u.slot_freed = asyncio.Event()
                if not await _wait_or_disconnect(u.slot_freed, receive, buffered):
                    return None
        finally:
            u.queued -= 1
        u.active += 1
        return _replay(buffered, receive)


async def _wait_or_disconnect(event: asyncio.Event, receive: Receive, buffered: list[Message]) -> bool:
    """Wait for `event` while reading the client's messages (kept in `buffered`; once the body is in, the next
    message is the disconnect); False if the client left."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        while not waiter.done():
            reader = asyncio.ensure_future(receive())
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                break
            msg = reader.result()
            if msg["type"] == "http.disconnect":
                return False
            buffered.append(msg)
        return True
    finally:
        waiter.cancel()


def _replay(buffered: list[Message], receive: Receive) -> Receive:
    pending = list(buffered)

    async def replaying() -> Message:
        return pending.pop(0) if pending else await receive()

    return replaying
