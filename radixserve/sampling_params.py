"""Per-request sampling settings, validated once at submission (bad values raise ValueError naming the field)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        args = {k: v for k, v in d.items() if v is not None}
        if isinstance(args.get("stop"), str):
            args["stop"] = [args["stop"]]
        sp = cls(**args)
        sp.validate()
        return sp

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
