"""Branch-solve-merge: fork the task into one branch per criterion, solve each branch, merge the verdicts.

    python examples/branch_solve_merge.py [--model PATH | --url http://127.0.0.1:30000]

The task text is prefilled once before the fork, so the branches start from cached pages; the merge step reads the
branches' variables back into the parent.
"""

from __future__ import annotations

import time

from common import HitRate, open_backend, parse_args, sgl

TASK = """Review this Python function.

def moving_average(values, window):
    result = []
    for i in range(len(values)):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
"""

CRITERIA = ["correctness (edge cases included)", "performance", "readability and naming"]


@sgl.function
def branch_solve_merge(s, task, criteria):
    s += sgl.system("You are a senior Python reviewer. Be specific and brief.")
    s += sgl.user_begin() + task
    branches = s.fork(len(criteria))  # branch: one copy per criterion, sharing the task's cached pages
    for f, criterion in zip(branches, criteria):
        f += f"\nJudge only its {criterion}, in at most two sentences." + sgl.user_end()
        f += sgl.assistant(sgl.gen("review", max_tokens=64, stop="\n\n"))
    branches.join()  # solve: every branch has run; s["review"] lists their answers
    s += "\nReviewers said:\n"
    for criterion, review in zip(criteria, s["review"]):
        s += f"- {criterion}: {review.strip()}\n"
    s += "Merge these reviews into one verdict with the single most important fix." + sgl.user_end()
    s += sgl.assistant(sgl.gen("verdict", max_tokens=96))  # merge


def main() -> None:
    args = parse_args("Fork a review into criteria, solve each branch, merge the answers.")
    with open_backend(args) as backend:
        hits = HitRate(backend)
        t0 = time.perf_counter()
        state = branch_solve_merge.run(task=TASK, criteria=CRITERIA, backend=backend, temperature=0)
        for criterion, review in zip(CRITERIA, state["review"]):
            print(f"[{criterion}] {review.strip()}\n")
        print(f"Verdict: {state['verdict'].strip()}\n")
        print(f"done in {time.perf_counter() - t0:.1f} s; {hits.report()}")


if __name__ == "__main__":
    main()
