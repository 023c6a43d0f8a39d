"""benchmarks/near_ties.py's report: the noise it measures and how it classes each parting (issue 38)."""

from __future__ import annotations

from benchmarks.near_ties import Scored, report
from benchmarks.quality import AGREE_TOKENS

N = AGREE_TOKENS


def rows(t: int) -> list[list[tuple[float, int]]]:
    """Every token's list: `t` on top, 9 the runner-up by 1.9."""
    return [[(-0.1, t), (-2.0, 9)]] * N


def test_report_classes_partings_by_the_reference_gap_against_the_largest_moves() -> None:
    same, near, far = [1] * N, [2] * N, [3] * N
    ref_top = [rows(t) for t in (1, 2, 3)]
    ref_top[1][5] = [(-0.50, 2), (-0.65, 7)]  # a near-tie at token 5: gap 0.15 teacher-forced
    ref_top[2][7] = [(-0.10, 3), (-1.10, 8)]  # a clear choice at token 7: gap 1.0
    ref_decoded = [list(r) for r in ref_top]
    ref_decoded[1][5] = [(-0.50, 2), (-0.60, 7)]  # as the reference chose: gap 0.1
    ref_decoded[0][2] = [(-0.3, 1), (-0.8, 9)]  # a near-tie both runs passed alike
    ref_lp = [[-0.1] * N for _ in range(3)]
    ref_lp[1][5] = -0.5
    ref = Scored([same, near, far], ref_decoded, ref_lp, ref_top)
    run_lp = [[-0.1] * N for _ in range(3)]
    run_lp[0][0] = -0.3  # the largest |d log-prob| and teacher-forced move (gap 1.9 -> 1.7): 0.2
    run_lp[1][5] = -0.6
    run_top = [rows(t) for t in (1, 2, 3)]
    run_top[0][0] = [(-0.3, 1), (-2.0, 9)]
    run_top[1][5] = [(-0.4, 7), (-0.6, 2)]  # the partings' own moves (0.35, 1.05) are not counted as noise
    run_top[2][7] = [(-0.05, 8), (-0.1, 3)]
    run_decoded = [list(r) for r in ref_decoded]
    run_decoded[2][3] = [(-0.1, 3), (-1.75, 9)]  # the largest move on the decode path: 0.25
    run_decoded[0][2] = [(-0.3, 1), (-0.7, 9)]  # the one move at a reference gap under 1: 0.1
    run_decoded[2][10] = [(-0.1, 3), (-0.2, 9)]  # past prompt 2's parting: not the same tokens, not counted
    run = Scored([same, near[:5] + [7] * (N - 5), far[:7] + [8] * (N - 7)], run_decoded, run_lp, run_top)
    lines = report("cfg", ref, run)
    assert "largest 0.2000 (prompt 0, token 0)" in lines[0]
    assert lines[1].startswith(f"cfg: top-2 gap moved, teacher-forced, over {3 * N - 2} tokens (not the partings)")
    assert lines[1].endswith("largest 0.2000")
    assert lines[2].startswith(f"cfg: top-2 gap moved, decode path, over {N + 5 + 7} tokens (before the partings)")
    assert "largest 0.2500; of those, the 1 where the reference's gap is under 1.0" in lines[2]
    assert lines[2].endswith("largest 0.1000")
    assert lines[3].startswith(
        "  prompt 1: parts at token 5: reference gap decoding 0.1000 (0.4x the largest move), teacher-forced 0.1500 "
        "(0.8x the largest move); teacher-forced, cfg's top is 0.2000 above"
    )
    assert "parts at token 7: reference gap decoding 1.0000 (4.0x" in lines[4] and "0.0500 above" in lines[4]
    assert lines[5].strip() == (
        f"1/3 prompts equal for all {N} tokens; of 2 partings, 1 within the noise of the decode path (the "
        "reference's gap as it chose <= the largest move there), 1 teacher-forced"
    )


def test_tokens_whose_runner_up_is_unknown_are_left_out_of_the_moves() -> None:
    run_top = rows(4)
    run_top[3] = [(-1.0, 4), (-1.5, 6)]  # the reference's runner-up (9) is not in the config's list
    run_lp = [[-0.1] * N]
    run_lp[0][3] = -1.0
    ref = Scored([[4] * N], [rows(4)], [[-0.1] * N], [rows(4)])
    lines = report("cfg", ref, Scored([[4] * N], [run_top], run_lp, [run_top]))
    assert lines[1].startswith(f"cfg: top-2 gap moved, teacher-forced, over {N - 1} tokens")
    assert lines[1].endswith("largest 0.0000") and lines[2].endswith("largest 0.0000")
    assert "of 0 partings" in lines[3]


def test_a_reference_token_that_is_not_its_own_top_counts_as_no_gap() -> None:
    top = [[(-0.1, 4), (-0.3, 5)]] * N  # the reference's answer (token 5 everywhere) is its runner-up
    ref = Scored([[5] * N], [top], [[-0.3] * N], [top])
    lines = report("cfg", ref, Scored([[4] * N], [top], [[-0.3] * N], [top]))
    assert "reference gap decoding 0.0000 (no move measured), teacher-forced 0.0000" in lines[3]
    assert "of 1 partings, 1 within the noise of the decode path" in lines[4]
