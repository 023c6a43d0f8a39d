"""The DSL's public constructors, named and shaped like SGLang's frontend language."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.sampling_params import SamplingParams

from frontend_dsl.choices import ChoicesSamplingMethod, token_length_normalized
from frontend_dsl.errors import NotSupportedError
from frontend_dsl.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    role_message,
)
from frontend_dsl.program import Program


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@function` (or `@function()`) turns `f(s, ...)` into a Program with run() and run_batch()."""
    if num_api_spec_tokens is not None:
        raise NotSupportedError(
            "function(num_api_spec_tokens=...) is not supported: API speculative execution "
            "exists for chat-only OpenAI models; frontend_dsl's OpenAI backend sends each gen "
            "after sgl.assistant as its own chat request instead"
        )
    if func is None:
        return Program
    return Program(func)


_DTYPES: dict[Any, str] = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
_DTYPES |= {t.__name__: regex for t, regex in _DTYPES.items()}  # SGLang also takes "int", "float", ...
_NUMBER_STOPS = [" ", "\n"]  # SGLang's runtime backend ends an int or float gen at the first of these


def _schema(json_schema: Any) -> str | dict[str, Any] | None:
    """A JSON schema from its text, a dict, or a pydantic model class (its model_json_schema())."""
    if json_schema is None or isinstance(json_schema, (str, dict)):
        return json_schema
    to_schema = getattr(json_schema, "model_json_schema", None)
    if callable(to_schema):
        return to_schema()
    raise TypeError(f"json_schema must be a JSON string, a dict or a pydantic model, got {type(json_schema).__name__}")


def _constraint(regex: str | None, json_schema: Any, dtype: Any) -> dict[str, Any]:
    if dtype is not None:
        if dtype not in _DTYPES:
            raise NotSupportedError(f"gen(dtype={dtype!r}) is not supported: use int, float, bool or str")
        if regex is not None or json_schema is not None:
            raise ValueError("give at most one of regex, json_schema, dtype")
        regex = _DTYPES[dtype]
    out = {"regex": regex, "json_schema": _schema(json_schema)}
    return {k: v for k, v in out.items() if v is not None}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
) -> Expr:
    """Generate text into variable `name`; unset sampling args come from run(). With choices=, acts as select().

    `regex=`, `json_schema=` (JSON text, a dict, or a pydantic model class) and `dtype=` (int, float, bool, str)
    constrain the output: the engine masks every token the grammar refuses."""
    if choices:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
        )
    if n not in (None, 1):
        raise NotSupportedError(f"gen(n={n}) is not supported: use s.fork({n}) for parallel samples")
    stops = [stop] if isinstance(stop, str) else stop
    if dtype in (int, float, "int", "float"):
        stops = [*(stops or []), *_NUMBER_STOPS]
    params = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": min_tokens,
        "stop": stops,
        "stop_regex": stop_regex,
        "stop_token_ids": stop_token_ids,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        **_constraint(regex, json_schema, dtype),
    }
    params = {k: v for k, v in params.items() if v is not None}
    SamplingParams.from_dict(params)  # a bad value fails here, at the line that wrote it
    logprobs = {
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
        "return_text_in_logprobs": return_text_in_logprobs,
    }
    return Gen(name, params | {k: v for k, v in logprobs.items() if v is not None})


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """SGLang's integer-typed gen: gen(dtype=int)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """SGLang's string-typed gen: gen(dtype=str), a double-quoted string of word characters and spaces."""
    return gen(name, dtype=str, **kwargs)


def image(expr: Any) -> Expr:
    raise NotSupportedError("sgl.image(...) is not supported: radixserve serves text-only models")


def video(path: str, num_frames: int) -> Expr:
    raise NotSupportedError("sgl.video(...) is not supported: radixserve serves text-only models")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    raise NotSupportedError(
        "sgl.separate_reasoning(...) is not supported: radixserve has no reasoning parser; "
        "split the gen's text on the model's think tags yourself"
    )


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append the choice choices_method picks from the choices' token logprobs after the text so far (default:
    the highest mean token logprob). Selection is deterministic: temperature is accepted, as SGLang's runtime
    backends accept it, and does not change it."""
    if not choices or not isinstance(choices, (list, tuple)):
        raise ValueError(f"select needs a non-empty list of choices, got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {choices!r}")
    return Select(name, list(choices), temperature, choices_method)


def system(expr: Any = None) -> Expr:
    """A system message around expr (text, gen, or a concatenation)."""
    return role_message("system", expr)


def user(expr: Any = None) -> Expr:
    """A user message around expr."""
    return role_message("user", expr)


def assistant(expr: Any = None) -> Expr:
    """An assistant message around expr (typically a gen)."""
    return role_message("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
