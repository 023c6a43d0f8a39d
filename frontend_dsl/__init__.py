"""frontend_dsl: a small Python DSL for LLM programs (gen, select, fork, roles) on radixserve, shaped like SGLang's
frontend language, so that `import frontend_dsl as sgl` runs SGLang programs. Shared prompts and forks become radix
cache hits: forks prefill their common prefix once, select scores all choices in one batched call, run_batch computes
its inputs' common prefix once."""
from frontend_dsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend_dsl.backends import Backend, Runtime, RuntimeEndpoint
from frontend_dsl.choices import ChoicesDecision, token_length_normalized
from frontend_dsl.default_backend import resolve_backend, set_default_backend
from frontend_dsl.errors import BackendError, ProgramError
from frontend_dsl.program import Program
from frontend_dsl.state import ProgramState, ProgramStateGroup


def flush_cache(backend: Backend | None = None) -> bool:
    """Empty the backend's (default: the default backend's) radix cache; False if requests were running."""
    return resolve_backend(backend).flush_cache()


__all__ = [
    "assistant", "assistant_begin", "assistant_end", "function", "gen", "select", "system", "system_begin",
    "system_end", "user", "user_begin", "user_end", "Backend", "Runtime", "RuntimeEndpoint", "ChoicesDecision",
    "token_length_normalized", "set_default_backend", "flush_cache", "BackendError", "ProgramError", "Program",
    "ProgramState", "ProgramStateGroup",
]
