"""Per-request sampling settings: one strict schema for every entry point (HTTP, Engine, DSL).

Types are strict (a bool is not a number, a float is not an int) and ranges bounded; a bad value raises
`ParamError(field, message)` at the call that passed it, before anything is queued, so no request can carry a
value that fails later inside the engine loop. Limits on counts (stop strings, stop ids, n) bound the work one
request can ask for; context-dependent checks (token ids inside the vocabulary, prompt + max_new_tokens inside the
context) are the engine's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from radixserve.errors import ParamError

MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128
MAX_GRAMMAR_CHARS = 1 << 20  # a regex, schema or EBNF grammar's text
MAX_SEED = 2**63 - 1  # a signed 64-bit seed (msgspec bounds ints to int64; torch takes any of them)
MAX_STOP_REGEX = 32  # patterns per request, as SGLang
MAX_STOP_REGEX_LENGTH = 256  # characters per pattern (SGLang: bytes)
MAX_LOGIT_BIAS = 1024  # biased ids per request
# SGLang fields we do not build: a clear 400 naming each beats an "unknown field" or a silently different output.
REFUSED = {
    "structural_tag": "structural tags are not built (use regex, json_schema or ebnf)",
    "watermark": "output watermarking is not built",
    "beam_width": "beam search is not built (beam_width may only be 1)",
}

StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=0)] = 128
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: off; 0 is refused by from_dict
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=100)] = 1.0
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_new_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # stop tokens and strings are held off until then
    stop_regex: (
        Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_REGEX_LENGTH)]
        | Annotated[
            list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_REGEX_LENGTH)]],
            msgspec.Meta(max_length=MAX_STOP_REGEX),
        ]
    ) = []
    no_stop_trim: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True
    # Only slow (Python) HF tokenizers honour it; ours are fast ones, which join special tokens as written, as SGLang's
    # default (fast) tokenizers do: accepted with the same effect as there.
    spaces_between_special_tokens: bool = True
    logit_bias: Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None  # token id -> bias
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None  # a stream's chunks every this many tokens
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    sampling_seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None  # SGLang's name for seed
    # Read only by a custom logit processor; /generate refuses those (custom_logit_processor), so nothing reads them.
    custom_params: dict[str, Any] | None = None
    structural_tag: Any = None  # REFUSED
    watermark: Any = None  # REFUSED
    beam_width: Any = None  # REFUSED past 1
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    # Constrained decoding (at most one; see radixserve/constrained/grammar.py): the output matches the grammar.
    regex: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_schema: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] | dict[str, Any] | None = None
    ebnf: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Validated params from a dict (None values mean 'unset') or re-validated from an instance."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            d = msgspec.structs.asdict(d)
        if not isinstance(d, dict):
            raise ParamError("sampling_params", f"must be an object, got {type(d).__name__}")
        try:
            params = msgspec.convert({k: v for k, v in d.items() if v is not None}, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise param_error(exc) from None
        if params.top_k == 0:
            raise ParamError("top_k", f"top_k must be -1 (off) or >= 1, got {params.top_k}")
        named = [f for f in ("regex", "json_schema", "ebnf") if getattr(params, f) is not None]
        if len(named) > 1:
            raise ParamError(named[1], f"give at most one of regex, json_schema, ebnf; got {', '.join(named)}")
        _check_sglang_fields(params)
        if params.sampling_seed is not None:
            if params.seed is not None and params.seed != params.sampling_seed:
                raise ParamError(
                    "sampling_seed", "seed and sampling_seed name the same seed: give one, or equal values"
                )
            params.seed = params.sampling_seed
        return params

    def replace(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    @property
    def grammar(self) -> tuple[str, Any] | None:
        """(field, source) of the grammar the output must match, if any."""
        for f in ("regex", "json_schema", "ebnf"):
            value = getattr(self, f)
            if value is not None:
                return f, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check_sglang_fields(params: SamplingParams) -> None:
    """SGLang's fields past the basic ones: refused ones, min_new_tokens' bound, patterns and logit_bias keys."""
    for name, why in REFUSED.items():
        value = getattr(params, name)
        if value is not None and not (name == "beam_width" and value == 1):
            raise ParamError(name, f"{name}: {why}")
    if params.min_new_tokens > params.max_new_tokens:
        raise ParamError(
            "min_new_tokens",
            f"min_new_tokens must be in [0, max_new_tokens ({params.max_new_tokens})], got {params.min_new_tokens}",
        )
    for pattern in params.stop_regex:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ParamError("stop_regex", f"stop_regex {pattern!r} is not a valid regex: {exc}") from None
    for key in params.logit_bias or {}:
        if not key.isdigit():
            raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")


FIELDS = frozenset(SamplingParams.__struct_fields__)
_PATH = re.compile(r" - at `\$(?:\.(?P<field>\w+))?(?P<rest>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`")


def param_error(exc: msgspec.ValidationError) -> ParamError:
    """The field a msgspec validation error is about, and its message without the `$.path` suffix."""
    text = str(exc)
    unknown = _UNKNOWN.match(text)
    if unknown:
        return ParamError(unknown.group("field"), f"unknown sampling parameter: {unknown.group('field')}")
    m = _PATH.search(text)
    if m is None:
        return ParamError("sampling_params", text)
    field = m.group("field") or "sampling_params"
    return ParamError(field, f"{field}{m.group('rest')}: {text[: m.start()]}")
