"""The process's default backend: what `prog.run()` uses when no `backend=` is given.

SGLang's documented API configures the backend once per process (`set_default_backend(...)`) and then runs programs
without naming it, so some process-level value is part of the API. It lives here and only here, is written only by
set_default_backend, and is read once per run (and by sgl.global_config.default_backend); `run(backend=...)` / `run_batch(backend=...)` bypass it entirely.
"""

from __future__ import annotations

from frontend_dsl.backends.base import Backend

_default: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """Use backend for programs run without backend= (None clears it)."""
    global _default
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"a backend must be a Runtime, RuntimeEndpoint or OpenAI, got {type(backend).__name__}")
    _default = backend


def current() -> Backend | None:
    """The default backend, or None."""
    return _default


def resolve_backend(backend: Backend | None) -> Backend:
    """backend if given, else the default one; a clear error when neither is set."""
    chosen = backend if backend is not None else _default
    if chosen is None:
        raise ValueError(
            "no backend: call frontend_dsl.set_default_backend(Runtime(...), RuntimeEndpoint(url) or "
            "OpenAI(model, base_url=...)) "
            "or pass backend= to run()"
        )
    if not isinstance(chosen, Backend):
        raise TypeError(f"a backend must be a Runtime, RuntimeEndpoint or OpenAI, got {type(chosen).__name__}")
    return chosen
