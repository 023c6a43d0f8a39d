"""Whether drafting pays on this machine, measured: tokens per second of the steps that verified drafts against those
of plain decode steps, per number of decodes in the step (`--speculative auto`).

What a verify row costs depends on the CPU and the weight format (measured: 1.07x a plain step at 1 decode on an AMX
machine in bf16, about 2.4x on a 2-core AVX-512 machine when 2+ rows read a bf16 copy of int8 codes, twice their
bytes). A fixed acceptance floor cannot fit every such case, so `auto` measures. Each step is timed from one scheduling to the next (execution, sampling, processing: what a
client waits for) when it held decodes only and the requests it ran are still running (no idle gap in between).
Where both kinds have been seen often enough, drafting goes on only while verify steps produce tokens at least as
fast as plain ones; either way a probe of the other kind now and then follows a change of workload (an answer
reaching text it can copy) or of load: every PROBE_EVERY-th step at first, twice as far apart after each probe that
left the choice as it was (up to MAX_PROBE_EVERY), back to PROBE_EVERY when the choice changes. A probe that fails
costs about 1.5 steps here; at one per 32 steps that was 4% of decode on text with nothing to copy (auto 0.96x of
off, issue 38), at one per 256 it is 0.6% (computed, not measured end to end)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EMA = 0.25  # weight of the newest step in each rate's moving average
MIN_SAMPLES = 4  # steps of a kind before its rate is trusted
PROBE_EVERY = 32  # steps between probes of the kind the gate does not choose, at first and after a change
MAX_PROBE_EVERY = 256  # the longest gap the probes back off to while the choice holds


@dataclass
class _Rates:
    plain: float = 0.0  # tokens/s of plain decode steps (moving average)
    verify: float = 0.0  # tokens/s of verify steps
    n_plain: int = 0
    n_verify: int = 0
    since_probe: int = 0
    probe_every: int = PROBE_EVERY
    pays: bool | None = None  # the choice at the last decision (None: not made yet)

    def add(self, verify: bool, rate: float) -> None:
        if verify:
            self.verify = rate if self.n_verify == 0 else (1 - EMA) * self.verify + EMA * rate
            self.n_verify += 1
        else:
            self.plain = rate if self.n_plain == 0 else (1 - EMA) * self.plain + EMA * rate
            self.n_plain += 1


@dataclass
class _Step:
    decodes: int
    ids: set[int]
    start: float
    pure: bool  # decodes only (a prefill chunk makes its time incomparable)
    tokens: int = 0  # accepted draft tokens it produced beyond one token per decode
    verified: bool = False


@dataclass
class CostGate:
    rates: dict[int, _Rates] = field(default_factory=dict)
    _step: _Step | None = None

    def begin(self, decode_ids: list[int], pure: bool, now: float | None = None) -> bool:
        """A step with these decodes is being scheduled: close the previous step's measurement, and say whether this
        one may draft."""
        now = time.perf_counter() if now is None else now
        prev = self._step
        if prev is not None and prev.pure and prev.ids.intersection(decode_ids):
            rate = (prev.decodes + prev.tokens) / max(now - prev.start, 1e-6)
            self.rates.setdefault(prev.decodes, _Rates()).add(prev.verified, rate)
        self._step = _Step(len(decode_ids), set(decode_ids), now, pure)
        return self._allow(len(decode_ids))

    def verified(self, accepted: int) -> None:
        """A draft of the current step was verified and `accepted` of its tokens kept."""
        if self._step is not None:
            self._step.verified = True
            self._step.tokens += accepted

    def _allow(self, decodes: int) -> bool:
        r = self.rates.setdefault(decodes, _Rates())
        r.since_probe += 1
        probe = r.since_probe >= r.probe_every
        if probe:
            r.since_probe = 0
        if r.n_verify < MIN_SAMPLES:
            return True  # learn what drafting gives (plain steps come by themselves: requests with nothing to draft)
        if r.n_plain < MIN_SAMPLES:
            return r.since_probe % 4 != 0  # requests draft whenever they can: take a plain step to measure
        pays = r.verify >= r.plain
        if pays != r.pays:
            r.pays, r.probe_every = pays, PROBE_EVERY
        elif probe:  # the probes since the last change left the choice as it was: probe half as often
            r.probe_every = min(2 * r.probe_every, MAX_PROBE_EVERY)
        return pays != probe
