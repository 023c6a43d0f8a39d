"""frontend_dsl: a Python DSL for LLM programs (gen, select, fork, roles) on radixserve, covering SGLang's frontend
language so that `import frontend_dsl as sgl` runs SGLang programs (README.md: what is supported, row by row).
Shared prompts and forks become radix cache hits: forks prefill their common prefix once, select scores all choices
in one batched call, run_batch computes its inputs' common prefix once."""

from radixserve import Engine
from frontend_dsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from frontend_dsl.backends import Backend, OpenAI, Runtime, RuntimeEndpoint
from frontend_dsl.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend_dsl.default_backend import resolve_backend, set_default_backend
from frontend_dsl.errors import BackendError, NotSupportedError, ProgramError
from frontend_dsl.global_config import global_config
from frontend_dsl.program import Program
from frontend_dsl.state import ProgramState, ProgramStateGroup


def flush_cache(backend: Backend | None = None, empty_cache: bool = True) -> bool:
    """Empty the backend's (default: the default backend's) radix cache; False if requests were running.
    empty_cache (SGLang: also release the CUDA allocator's cache) is accepted; the engine keeps its fixed KV pool."""
    return resolve_backend(backend).flush_cache()


def pin(prompt: str, backend: Backend | None = None) -> dict:
    """Keep the prompt's cached prefix out of eviction (radixserve's /cache/pin, up to max_pinned_share of the pool):
    programs that start with it keep hitting the cache under memory pressure. {"pinned_tokens", "prompt_tokens"}."""
    return resolve_backend(backend).pin(prompt)


def unpin(prompt: str, backend: Backend | None = None) -> bool:
    """Release sgl.pin(prompt); False if it was not pinned."""
    return resolve_backend(backend).unpin(prompt)


def get_server_info(backend: Backend | None = None) -> dict:
    """What the backend's server reports about itself (model path, context length, chat template, ...)."""
    return resolve_backend(backend).get_server_info()


__all__ = [
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "image",
    "select",
    "separate_reasoning",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
    "video",
    "Backend",
    "global_config",
    "Engine",
    "OpenAI",
    "Runtime",
    "RuntimeEndpoint",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "greedy_token_selection",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "set_default_backend",
    "flush_cache",
    "pin",
    "unpin",
    "get_server_info",
    "BackendError",
    "NotSupportedError",
    "ProgramError",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
]
