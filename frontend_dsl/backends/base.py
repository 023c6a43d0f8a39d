"""What a program needs from a model: generation over text or token ids, tokenization, the chat template, cache stats.

The cache-aware operations (prefill a shared prefix, score select choices in one batched call) are written once here
on top of those primitives, so the in-process and HTTP backends send the same requests.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from frontend_dsl.errors import BackendError
from frontend_dsl.roles import RoleTemplates


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Backend(ABC):
    def __init__(self) -> None:
        self._roles: RoleTemplates | None = None
        self._roles_lock = threading.Lock()

    @abstractmethod
    def generate(self, *, text: str | None = None, input_ids: list[list[int]] | None = None,
                 sampling_params: dict[str, Any] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0) -> dict[str, Any] | list[dict[str, Any]]:
        """Engine-shaped output: a dict for `text`, a list of dicts for a batch of `input_ids`."""

    @abstractmethod
    def generate_stream(self, text: str, sampling_params: dict[str, Any], return_logprob: bool = False,
                        logprob_start_len: int = -1, top_logprobs_num: int = 0) -> Iterator[dict[str, Any]]:
        """Chunks whose "text" holds only what is new; the last one has meta_info["finish_reason"] set."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The token ids the engine would compute for a `text` prompt."""

    @abstractmethod
    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied to messages, without a generation prompt."""

    @abstractmethod
    def cache_stats(self) -> dict[str, Any]:
        """At least {"hit_tokens", "prompt_tokens", "hit_rate"} since the engine started."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Empty the radix cache; False if requests were running (nothing flushed)."""

    def prefill(self, text: str) -> None:
        """Compute text into the radix cache without generating (so later requests that extend it hit the cache)."""
        self.generate(text=text, sampling_params={"max_new_tokens": 0})

    def role_templates(self) -> RoleTemplates:
        """The chat template's role segments, cut once per backend."""
        with self._roles_lock:
            if self._roles is None:
                self._roles = RoleTemplates(self.render_chat)
            return self._roles

    def choice_logprobs(self, prefix: str, choices: list[str]) -> list[list[float]]:
        """Logprob of each token of each choice as a continuation of prefix, from ONE batched prompt-logprob call.

        A choice's tokens are those of tokenize(prefix + choice) after its common prefix with tokenize(prefix): at the
        boundary the two texts can tokenize differently, and the choice must be scored as the model would read it.
        The prefix is prefilled first, so the batch computes only the choices, not the prefix once per choice.
        """
        prefix_ids = self.tokenize(prefix) if prefix else []
        seqs = [self.tokenize(prefix + c) for c in choices]
        starts = [common_prefix_len(prefix_ids, ids) for ids in seqs]
        first = min(starts)
        if prefix and len(choices) > 1:
            self.prefill(prefix)
        outs = self.generate(input_ids=seqs, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                             logprob_start_len=first)
        if not isinstance(outs, list) or len(outs) != len(seqs):
            raise BackendError(f"scoring {len(seqs)} choices returned {type(outs).__name__} "
                               f"of {len(outs) if isinstance(outs, list) else 1} results")
        result = []
        for ids, start, out in zip(seqs, starts, outs):
            entries = out["meta_info"].get("input_token_logprobs") or []
            if len(entries) != len(ids) - first:
                raise BackendError(f"asked prompt logprobs from position {first} of {len(ids)} tokens, "
                                   f"got {len(entries)} entries")
            picked = entries[start - first:]
            if [int(tid) for _, tid in picked] != ids[start:]:
                raise BackendError("prompt logprobs came back for other tokens than the ones sent")
            result.append([float(lp) for lp, _ in picked if lp is not None])
        return result
