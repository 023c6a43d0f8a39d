"""The router's shared state: the worker pool, the policy, the upstream HTTP client, counters, health transitions."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import httpx

from radixserve.router.config import RouterConfig
from radixserve.router.policy import Policy
from radixserve.router.workers import Worker, WorkerPool

log = logging.getLogger("radixserve.router")


@dataclass
class Router:
    pool: WorkerPool
    policy: Policy
    config: RouterConfig = field(default_factory=RouterConfig)
    decisions: Counter = field(default_factory=Counter)  # (worker url, reason) -> requests
    retries: int = 0
    worker_failures: Counter = field(default_factory=Counter)  # worker url -> failed requests
    _client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """Made on first use, inside the serving event loop (an AsyncClient belongs to the loop that uses it)."""
        if self._client is None:
            timeout = httpx.Timeout(self.config.connect_timeout_s, read=self.config.read_timeout_s)
            # No pool limit: every client request holds one upstream connection; the workers admit and queue.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def add_worker(self, url: str) -> tuple[Worker, bool]:
        w, new = self.pool.add(url)
        if new:
            log.info("worker added: %s", w.url)
        return w, new

    def remove_worker(self, url: str) -> Worker | None:
        w = self.pool.remove(url)
        if w is not None:
            self.policy.forget(w.url)
            log.info("worker removed: %s", w.url)
        return w

    def request_failed(self, worker: Worker, why: str) -> None:
        """A request could not reach the worker or broke off: stop sending it traffic until a health check passes."""
        self.worker_failures[worker.url] += 1
        worker.failures = max(worker.failures, self.config.failure_threshold)
        if worker.healthy:
            log.warning(
                "worker %s failed a request (%s): out of rotation until it passes a health check", worker.url, why
            )
        worker.healthy = False

    def health_result(self, worker: Worker, ok: bool) -> None:
        if ok:
            worker.failures = 0
            if not worker.healthy and not worker.removed:
                # Its cache may be gone (a restart): forget what the tree says it holds rather than route on it.
                self.policy.forget(worker.url)
                worker.healthy = True
                log.info("worker %s is healthy again", worker.url)
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.config.failure_threshold:
            worker.healthy = False
            log.warning("worker %s failed %d health checks: out of rotation", worker.url, worker.failures)
