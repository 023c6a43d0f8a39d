"""What one scenario came to, and how an exception a library raised is read: a server error (an HTTP error status, a
dropped connection, or a library failing on the shape of our response) or a model failure (the model wrote the
wrong thing: no call, invalid output, a loop). Runs in the libraries' interpreter: standard library only."""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass
from enum import Enum


class Kind(str, Enum):
    PASSED = "passed"
    MODEL = "model failure"
    SERVER = "server error"
    TIMEOUT = "timeout"  # given by the runner when a scenario outlives its limit


@dataclass
class Outcome:
    library: str
    scenario: str
    kind: Kind
    detail: str = ""
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "kind": self.kind.value})

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        d = json.loads(text)
        return cls(d["library"], d["scenario"], Kind(d["kind"]), d["detail"], d["seconds"])


class ModelFailure(Exception):
    """A scenario's own check found the model's work wrong (no call, a wrong argument, no answer)."""


def expect(condition: object, what: str) -> None:
    """Fail the scenario as the model's fault unless `condition` holds; `what` says what was expected."""
    if not condition:
        raise ModelFailure(what)


# Exceptions the libraries raise when the model's output is wrong, by class name (the classes live in libraries
# this module cannot import): a loop past max turns, invalid output after retries, a length cut.
MODEL_ERRORS = {
    "ModelFailure": "",
    "ModelBehaviorError": "agents: ",
    "MaxTurnsExceeded": "agents: ",
    "UnexpectedModelBehavior": "pydantic-ai: ",
    "GraphRecursionError": "langgraph: ",
    "InstructorRetryException": "instructor: ",
    "IncompleteOutputException": "instructor: ",
    "LengthFinishReasonError": "openai: ",
    "ContentFilterFinishReasonError": "openai: ",
    "OutputParserException": "langchain: ",
    "ValidationError": "pydantic: ",
    "JSONDecodeError": "json: ",
    "OutputTokenLimitExceeded": "pydantic-ai: ",
    "IncompleteToolCall": "pydantic-ai: ",
}
# Transport failures: the server went away or broke the HTTP exchange.
TRANSPORT_ERRORS = {
    "APIConnectionError",
    "RemoteProtocolError",
    "ReadError",
    "ConnectError",
    "ServerDisconnectedError",
    "ModelConnectionError",  # pydantic-ai's
    "ModelServerError",
}


def classify(exc: BaseException) -> tuple[Kind, str]:
    """A server error if any exception in the chain carries an HTTP error status or is a transport failure; else a
    model failure if one is a known model-output error; else a protocol error (a library choked on our response),
    which counts against the server, with the traceback's last frame to show where."""
    chain = _chain(exc)
    for e in chain:
        status = _status(e)
        if status is not None and status >= 400:
            return Kind.SERVER, f"HTTP {status}: {_short(e)}"
        if type(e).__name__ in TRANSPORT_ERRORS:
            return Kind.SERVER, f"{type(e).__name__}: {_short(e)}"
    for e in chain:
        if type(e).__name__ in MODEL_ERRORS:
            return Kind.MODEL, MODEL_ERRORS[type(e).__name__] + _short(e)
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {where[0].filename.split('site-packages/')[-1]}:{where[0].lineno}" if where else ""
    return Kind.SERVER, f"protocol: {type(exc).__name__}: {_short(exc)}{at}"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status_code", None)
    if status is None:
        status = getattr(getattr(e, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
