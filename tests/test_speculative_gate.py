"""`--speculative auto`'s cost gate (radixserve/speculative/gate.py): drafting goes on only while verify steps are
measured to produce tokens faster than plain ones, with probes of the other kind; on the engine, a workload whose
drafts fail keeps drafting rare."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve.speculative.gate import MAX_PROBE_EVERY, MIN_SAMPLES, PROBE_EVERY, CostGate


def drive(gate: CostGate, steps: int, plain_s: float, verify_s: float, accepted: int) -> list[bool]:
    """Steps of one request (1 decode), back to back: what the gate allowed each step. An allowed step verifies a
    draft (accepting `accepted` tokens) and takes verify_s; a refused one is a plain step of plain_s."""
    now, allowed = 0.0, []
    for _ in range(steps):
        ok = gate.begin([1], pure=True, now=now)
        allowed.append(ok)
        if ok:
            gate.verified(accepted)
        now += verify_s if ok else plain_s
    return allowed


def test_gate_closes_when_verify_steps_are_slower_and_probes() -> None:
    gate = CostGate()
    # A verify step costs 2.4x a plain one and accepts nothing: 0.42x the tokens/s.
    allowed = drive(gate, 200, plain_s=0.1, verify_s=0.24, accepted=0)
    tail = allowed[60:]
    assert not all(allowed) and sum(tail) <= len(tail) // PROBE_EVERY + 1, allowed
    assert any(tail), "it probes now and then"
    r = gate.rates[1]
    assert r.n_plain >= MIN_SAMPLES and r.verify < r.plain


def test_gate_stays_open_when_verify_steps_pay() -> None:
    gate = CostGate()
    # The same cost, 5 tokens accepted per verify step: 6 tokens per 0.24 s against 1 per 0.1 s.
    allowed = drive(gate, 200, plain_s=0.1, verify_s=0.24, accepted=5)
    tail = allowed[60:]
    assert len(tail) - sum(tail) <= len(tail) // PROBE_EVERY + 1, allowed
    assert not all(tail), "a plain step now and then keeps the plain rate current"


def test_steps_with_prefill_or_after_an_idle_gap_are_not_measured() -> None:
    gate = CostGate()
    gate.begin([1], pure=False, now=0.0)
    gate.begin([1], pure=True, now=5.0)  # the previous step held a prefill chunk: not counted
    gate.begin([2], pure=True, now=5.1)  # request 1 ended and 2 came: maybe after an idle gap, not counted
    gate.begin([2], pure=True, now=5.2)  # counted: 1 token in 0.1 s
    r = gate.rates[1]
    assert (r.n_plain, r.n_verify) == (1, 0) and r.plain == pytest.approx(10.0)


def test_auto_engine_measures_and_keeps_outputs(tiny_model_dir: Path, make_engine) -> None:
    """auto on the engine: the gate measured both kinds of step, and greedy tokens are those of speculation off."""
    rng = random.Random(5)
    passage = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [passage * 2, [rng.randrange(3, 500) for _ in range(30)]]
    params = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
    off = make_engine(tiny_model_dir, speculative="off")
    auto = make_engine(tiny_model_dir)
    for p in prompts:
        want = off.generate(input_ids=p, sampling_params=params)["output_ids"]
        assert auto.generate(input_ids=p, sampling_params=params)["output_ids"] == want
    rates = auto.loop.call(lambda: auto.scheduler.drafter.gate.rates)
    assert rates[1].n_verify > 0 and rates[1].n_plain > 0, rates


def test_probes_back_off_while_the_choice_holds_and_return_when_it_changes() -> None:
    """Drafts that never pay: probes grow sparse (a failed one costs ~1.5 steps); once drafts pay, the next probe
    opens the gate again."""
    gate = CostGate()
    allowed = drive(gate, 2000, plain_s=0.1, verify_s=0.24, accepted=0)
    late = allowed[1000:]
    assert 0 < sum(late) <= len(late) // MAX_PROBE_EVERY + 1, sum(late)
    assert gate.rates[1].probe_every == MAX_PROBE_EVERY
    allowed = drive(gate, 2 * MAX_PROBE_EVERY + 100, plain_s=0.1, verify_s=0.24, accepted=5)
    reopened = allowed.index(True)
    assert reopened <= MAX_PROBE_EVERY and gate.rates[1].pays
    tail = allowed[-200:]
    assert len(tail) - sum(tail) <= 200 // PROBE_EVERY + 1, "drafting again, plain probes backing off in turn"
