"""Errors that callers of the Engine (and the HTTP server) tell apart."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served (HTTP 503)."""


class ParamError(ValueError):
    """A request parameter is invalid: `field` names it as the caller spelled it (HTTP 400 with `param`)."""

    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone (a bug or a fault): it was finished and what it held freed; other
    requests go on (HTTP 500 with a generic body naming the request id). The traceback is in the server log."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"internal error while serving request {rid}")
        self.rid = rid


class GrammarFailedError(ParamError):
    """A request's grammar passed the checks made before queueing, then went past one of llguidance's limits while
    the request ran (a parser row over its item limit, a step over its fuel): the request ended there, and the
    caller hears which field (HTTP 400, code `grammar_too_complex`), not an internal error."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message, code="grammar_too_complex")
