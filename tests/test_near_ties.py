"""benchmarks/near_ties.py's report: the noise it measures and how it classes each parting (issue 38)."""

from __future__ import annotations

from benchmarks.near_ties import Scored, report
from benchmarks.quality import AGREE_TOKENS

N = AGREE_TOKENS


def test_report_classes_partings_by_the_reference_gap_against_the_largest_noise() -> None:
    same, near, far = [1] * N, [2] * N, [3] * N
    ref_top = [[[(-0.1, t), (-2.0, 9)]] * N for t in (1, 2, 3)]
    ref_top[1][5] = [(-0.50, 2), (-0.65, 7)]  # a near-tie at token 5: gap 0.15, within twice the noise
    ref_top[2][7] = [(-0.10, 3), (-1.10, 8)]  # a clear choice at token 7: gap 1.0
    ref_lp = [[-0.1] * N for _ in range(3)]
    ref_lp[1][5] = -0.5
    ref = Scored([same, near, far], ref_lp, ref_top)
    run_lp = [[-0.1] * N for _ in range(3)]
    run_lp[0][0] = -0.2  # the largest |d log-prob|: 0.1
    run_lp[1][5] = -0.6
    run_top = [[[(-0.1, t), (-2.0, 9)]] * N for t in (1, 2, 3)]
    run_top[1][5] = [(-0.4, 7), (-0.6, 2)]
    run_top[2][7] = [(-0.05, 8), (-0.1, 3)]
    run = Scored([same, near[:5] + [7] * (N - 5), far[:7] + [8] * (N - 7)], run_lp, run_top)
    lines = report("cfg", ref, run)
    assert "largest 0.1000 (prompt 0, token 0)" in lines[0]
    assert "prompt 1: parts at token 5: reference gap 0.1500 (1.5x" in lines[1]
    assert "cfg prefers its token by 0.2000" in lines[1]
    assert "prompt 2: parts at token 7: reference gap 1.0000 (10.0x" in lines[2]
    assert "cfg prefers its token by 0.0500" in lines[2]
    assert lines[3].strip().startswith(f"1/3 prompts equal for all {N} tokens; 1 of 2 partings within the noise")
    assert lines[3].strip().endswith("0 within 2x its p99")  # p99 of 3 x 64 values: 0.0


def test_a_reference_token_that_is_not_its_own_top_counts_as_no_gap() -> None:
    top = [[[(-0.1, 4), (-0.3, 5)]] * N]  # the reference's answer (token 5 everywhere) is its runner-up
    ref = Scored([[5] * N], [[-0.3] * N], top)
    run_lp = [[-0.3] * N]
    run_lp[0][3] = -0.35
    lines = report("cfg", ref, Scored([[4] * N], run_lp, top))
    assert "reference gap 0.0000" in lines[1] and "not its top-1 when scored" in lines[1]
    assert "1 of 1 partings within the noise" in lines[2]
