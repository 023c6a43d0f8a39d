"""Background upkeep in a thread of its own: health checks of every worker, and eviction of the approximate tree.

A thread, not a task of the serving loop: it runs the same under any ASGI server (and under servers started without
a lifespan, as the tests' BackgroundServer is), and a slow worker's check never delays routing.
"""

from __future__ import annotations

import threading
import time

import httpx

from radixserve.router.policy import CacheAware
from radixserve.router.state import Router
from radixserve.router.workers import Worker


def check(client: httpx.Client, worker: Worker) -> bool:
    try:
        return client.get(worker.url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


class Upkeep:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="radixserve-router-upkeep")
        self.client = httpx.Client(timeout=router.config.health_timeout_s)
        self.last_eviction = time.monotonic()

    def start(self) -> "Upkeep":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.client.close()

    def check_all(self) -> None:
        for w in self.router.pool.all():
            self.router.health_result(w, check(self.client, w))

    def run(self) -> None:
        policy = self.router.policy
        while not self.stop_event.is_set():
            self.check_all()
            if (
                isinstance(policy, CacheAware)
                and time.monotonic() - self.last_eviction >= policy.config.eviction_interval_s
            ):
                policy.evict()
                self.last_eviction = time.monotonic()
            self.stop_event.wait(self.router.config.health_interval_s)
