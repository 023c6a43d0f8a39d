"""Errors a DSL caller tells apart: the model server failed, or a program failed."""

from __future__ import annotations


class BackendError(RuntimeError):
    """The backend could not serve a call: server unreachable or timed out, an HTTP error status, a dead engine."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when the server answered one


class ProgramError(RuntimeError):
    """A program raised (or one of its backend calls failed); carries the program's name and its text so far."""

    def __init__(self, program_name: str, cause: BaseException, state_text: str) -> None:
        tail = state_text if len(state_text) <= 2000 else "..." + state_text[-2000:]
        super().__init__(
            f"program {program_name!r} failed: {type(cause).__name__}: {cause}\n"
            f"--- state so far ({len(state_text)} chars) ---\n{tail}"
        )
        self.program_name = program_name
        self.cause = cause
        self.state_text = state_text


class NotSupportedError(NotImplementedError):
    """A part of SGLang's frontend API that frontend_dsl refuses rather than silently ignores; the message names the
    call and says why (see frontend_dsl/README.md for the full table)."""
