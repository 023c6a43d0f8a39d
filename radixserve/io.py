"""The typed request and results shared by the server, the Engine and the DSL: `GenerateRequest` in, `GenerateOutput`
(one whole result) or `StreamChunk`s (a result piece by piece) out, each ending with a `FinishReason`.

Results encode to the documented JSON shape `{"text", "output_ids", "meta_info": {...}}` as they are (msgspec
encodes the structs field by field); `to_dict()` gives the same shape for the Engine's dict API. Nothing past this
module builds or reads result dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from radixserve.cache.retention import DEFAULT_PRIORITY

LogprobEntry = tuple[float | None, int]  # (logprob, token id); a prompt's first token has no logprob
TopLogprobs = list[tuple[float, int]] | None


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended. matched: the stop token id or stop string that ended it (None otherwise); message: what
    went wrong, for abort and error."""

    type: Literal["stop", "length", "abort", "error"]
    matched: int | str | None
    message: str | None = None

    @property
    def stopped_on_string(self) -> bool:
        return self.type == "stop" and isinstance(self.matched, str)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            d["message"] = self.message
        return d


STOP_LENGTH = FinishReason("length", None)
ABORTED = FinishReason("abort", None, "aborted")
INTERNAL_ERROR = FinishReason("error", None, "internal error")


class OutputMeta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """meta_info of a result: counts are cumulative (also in a stream); logprob lists appear only when asked for
    (in a stream, the output ones hold only what is new, the input ones come with the first chunk)."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    ttft: float | None
    e2e_latency: float
    output_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs_length: int | None = None  # output logprobs so far, this chunk's included
    output_top_logprobs: list[TopLogprobs] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[TopLogprobs] | None = None
    output_token_ids_logprobs: list[TopLogprobs] | None = None  # token_ids_logprob's (logprob, id) per position
    input_token_ids_logprobs: list[TopLogprobs] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "finish_reason":
                d[name] = None if value is None else value.to_dict()
            elif value is not None or name in _ALWAYS:
                d[name] = value
        return d


_ALWAYS = frozenset(("finish_reason", "ttft"))


class GenerateOutput(msgspec.Struct):
    """One request's whole result (or, as a StreamChunk, what is new since the previous chunk)."""

    text: str
    output_ids: list[int]
    meta_info: OutputMeta

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.meta_info.finish_reason

    @property
    def finished(self) -> bool:
        return self.meta_info.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info.to_dict()}


class StreamChunk(GenerateOutput):
    """A piece of a streamed result: text, output_ids and output logprobs hold only what is new since the previous
    chunk; counts are cumulative; the last chunk has the finish_reason."""


@dataclass(frozen=True)
class GenerateRequest:
    """One engine call: a prompt as text or token ids (a list of them for a batch), its sampling params as given
    (a dict, a list of dicts with one per prompt, or a SamplingParams; the engine validates them and fills what is
    unset from the model's defaults), logprob options, the cache namespace, the request id(s) and scheduling.

    The fields are in the order of `Engine.generate`'s arguments, which builds one from them as given."""

    prompt: str | list[str] | None = None
    sampling_params: Any = None
    input_ids: list[int] | list[list[int]] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str = ""
    rid: str | list[str] | None = None
    priority: int = 0  # higher runs first and may retract lower-priority requests
    timeout: float | None = None  # seconds after which the request is aborted and its pages freed
    tenant: str | None = None  # whose fair share of prefill it uses (None: its cache_salt)
    # with return_logprob, the logprob of each of these ids at every position (a list of them per prompt for a batch)
    token_ids_logprob: list[int] | list[list[int]] | None = None
    # keep the finished request's cached prefix (prompt + output) ahead of LRU eviction for this many seconds after
    # its last hit (radixserve/cache/retention.py), at this priority (1..100; higher is evicted later)
    retention_seconds: float | None = None
    retention_priority: int = DEFAULT_PRIORITY
