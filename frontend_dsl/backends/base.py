"""What a program needs from a model: generation over text or token ids, tokenization, the chat template, cache stats.

The cache-aware operations (prefill a shared prefix, score select choices in one batched call) are written once here
on top of those primitives, so the in-process and HTTP backends send the same requests.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from frontend_dsl.errors import BackendError, NotSupportedError
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
    def generate(
        self,
        *,
        text: str | None = None,
        input_ids: list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Engine-shaped output: a dict for `text`, a list of dicts for a batch of `input_ids`."""

    @abstractmethod
    def generate_stream(
        self,
        text: str,
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> Iterator[dict[str, Any]]:
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
    def get_server_info(self) -> dict[str, Any]:
        """What the model server reports about itself (model path, context length, ...)."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Empty the radix cache; False if requests were running (nothing flushed)."""

    def pin(self, text: str) -> dict[str, Any]:
        """Keep text's cached prefix out of eviction (radixserve's /cache/pin); {"pinned_tokens", "prompt_tokens"}."""
        raise NotSupportedError(f"{type(self).__name__} cannot pin prompts: pinning is a radixserve cache feature")

    def unpin(self, text: str) -> bool:
        """Release a pin of the same text; False if there was none."""
        raise NotSupportedError(f"{type(self).__name__} cannot unpin prompts: pinning is a radixserve cache feature")

    def prefill(self, text: str) -> None:
        """Compute text into the radix cache without generating (so later requests that extend it hit the cache)."""
        self.generate(text=text, sampling_params={"max_new_tokens": 0})

    def role_templates(self) -> RoleTemplates:
        """The chat template's role segments, cut once per backend."""
        with self._roles_lock:
            if self._roles is None:
                self._roles = RoleTemplates(self.render_chat)
            return self._roles

    def score_choices(self, prefix: str, choices: list[str], unconditional: bool = False) -> dict[str, Any]:
        """Each choice's tokens scored as a continuation of prefix, as a ChoicesSamplingMethod takes them:
        input_token_logprobs (per choice: (logprob, token_id, token_text) of exactly the choice's tokens),
        normalized_prompt_logprobs (their means), output_token_logprobs (empty: nothing is generated) and, if
        `unconditional`, unconditional_token_logprobs (the same tokens scored with no prompt before them).

        A choice's tokens are those of tokenize(prefix + choice) after its common prefix with tokenize(prefix): at the
        boundary the two texts can tokenize differently, and the choice must be scored as the model would read it.
        The prefix is prefilled first, so ONE batched call computes only the choices, not the prefix once per choice.
        """
        prefix_ids = self.tokenize(prefix) if prefix else []
        seqs = [self.tokenize(prefix + c) for c in choices]
        starts = [common_prefix_len(prefix_ids, ids) for ids in seqs]
        if prefix and len(choices) > 1:
            self.prefill(prefix)
        entries = self._prompt_logprobs(seqs, min(starts), starts)
        scores = {
            "normalized_prompt_logprobs": [mean_logprob(e) for e in entries],
            "input_token_logprobs": entries,
            "output_token_logprobs": [[] for _ in choices],
        }
        if unconditional:
            scores["unconditional_token_logprobs"] = self._prompt_logprobs(
                [ids[start:] for ids, start in zip(seqs, starts)], 0, [0] * len(seqs)
            )
        return scores

    def _prompt_logprobs(self, seqs: list[list[int]], first: int, starts: list[int]) -> list[list[tuple]]:
        """Prompt logprob entries of seqs[i][starts[i]:] from one batched call asking them from position `first`."""
        outs = self.generate(
            input_ids=seqs,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=first,
            return_text_in_logprobs=True,
        )
        if not isinstance(outs, list) or len(outs) != len(seqs):
            raise BackendError(
                f"scoring {len(seqs)} choices returned {type(outs).__name__} "
                f"of {len(outs) if isinstance(outs, list) else 1} results"
            )
        result = []
        for ids, start, out in zip(seqs, starts, outs):
            entries = out["meta_info"].get("input_token_logprobs") or []
            if len(entries) != len(ids) - first:
                raise BackendError(
                    f"asked prompt logprobs from position {first} of {len(ids)} tokens, got {len(entries)} entries"
                )
            picked = [tuple(e) for e in entries[start - first :]]
            if [int(e[1]) for e in picked] != ids[start:]:
                raise BackendError("prompt logprobs came back for other tokens than the ones sent")
            result.append(picked)
        return result


def mean_logprob(entries: list[tuple]) -> float:
    lps = [float(e[0]) for e in entries if e[0] is not None]
    return sum(lps) / len(lps) if lps else -math.inf
