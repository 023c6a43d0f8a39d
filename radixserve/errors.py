"""Errors that callers of the Engine (and the HTTP server) tell apart."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served (HTTP 503)."""
