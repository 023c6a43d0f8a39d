"""The router's retry and health-check settings, apart from state.py so that reading their defaults (the CLI
parser does, for every command) does not import httpx (~70 ms of `radixserve serve`'s start)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    max_attempts: int = 3  # workers tried per request before answering 503
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = None  # generation may take long between bytes only for huge prefills: no limit
    health_interval_s: float = 5.0
    health_timeout_s: float = 3.0
    failure_threshold: int = 2  # consecutive failed health checks before a worker stops taking traffic
