"""The router's workers: their URLs, health and in-flight load, added and removed at run time."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port' (one spelling per worker, so add/remove agree)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not a worker URL: {url!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(eq=False)
class Worker:
    url: str
    healthy: bool = True  # optimistic: a new worker takes traffic at once; a failed request or check turns it off
    load: int = 0  # requests the router has in flight on it (what the balance thresholds compare)
    failures: int = 0  # consecutive failed health checks
    requests: int = 0  # requests sent to it since it was added
    removed: bool = False

    def info(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "requests": self.requests}


@dataclass
class WorkerPool:
    """The set of workers, shared by the serving loop and the health-check thread (a lock guards membership;
    single attribute writes such as `healthy` are atomic under the GIL)."""

    workers: dict[str, Worker] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, url: str) -> tuple[Worker, bool]:
        """The worker at url, and whether it was new."""
        url = normalize_url(url)
        with self.lock:
            if url in self.workers:
                return self.workers[url], False
            w = Worker(url)
            self.workers[url] = w
            return w, True

    def remove(self, url: str) -> Worker | None:
        """Take url out of rotation; its in-flight requests finish (they hold the Worker object)."""
        with self.lock:
            w = self.workers.pop(normalize_url(url), None)
        if w is not None:
            w.removed = True
        return w

    def all(self) -> list[Worker]:
        with self.lock:
            return list(self.workers.values())

    def healthy(self, exclude: set[str] = frozenset()) -> list[Worker]:  # type: ignore[assignment]
        return [w for w in self.all() if w.healthy and w.url not in exclude]
