"""Which speculation an engine runs: `--speculative {auto,off,ngram}` resolved for its device and overlap setting."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.errors import ParamError

MODES = ("auto", "off", "ngram")
# `auto` drafts only in steps with at most this many decodes: a verify row is nearly free while a CPU step is bound
# by reading the weights, and costs compute once the step is compute-bound. Measured on the default model (2 AVX-512
# cores, benchmarks/speculative.py --step-cost): 8 extra tokens per request cost 1.07x a plain step at 1 decode,
# 1.26x at 2, 1.39x at 4, 1.93x at 8; a request drafting at the 20% floor (k adapts down) still yields more.
AUTO_MAX_BATCH = 4


@dataclass(frozen=True)
class SpecChoice:
    enabled: bool
    max_batch: int | None  # no drafts in steps with more decodes than this (None: any)
    overlap: bool  # the overlap setting the engine runs with
    reason: str
    measured: bool = False  # draft only while verify steps are measured to pay (speculative/gate.py): auto


def choose_speculative(mode: str, device_type: str, overlap: bool | None) -> SpecChoice:
    """Speculation needs each request's last token on the CPU before its step is built (to draft from it), so it
    runs with overlap scheduling off; verify steps are extends, which never replay CUDA graphs."""
    default_overlap = device_type == "cuda" if overlap is None else overlap
    if mode == "off":
        return SpecChoice(False, None, default_overlap, "off")
    if mode == "ngram":
        if overlap:
            raise ParamError(
                "speculative",
                "speculative 'ngram' needs overlap_schedule off (a draft is built from "
                "the token the previous step sampled)",
            )
        return SpecChoice(True, None, False, "ngram: on (overlap scheduling off)")
    if device_type == "cuda":
        return SpecChoice(
            False,
            None,
            default_overlap,
            "auto: off on CUDA (verify steps would give up overlap scheduling and CUDA graphs; not measured there)",
        )
    if overlap:
        return SpecChoice(False, None, True, "auto: off (overlap_schedule was asked for)")
    return SpecChoice(
        True,
        AUTO_MAX_BATCH,
        False,
        f"auto: on, in steps of at most {AUTO_MAX_BATCH} decodes where verify steps are measured to pay (CPU)",
        measured=True,
    )
