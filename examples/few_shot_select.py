"""A few-shot classifier: the labelled examples are a shared prefix, and select scores every label in one call.

python examples/few_shot_select.py [--model PATH | --url http://127.0.0.1:30000]
"""

from __future__ import annotations

import time

from common import HitRate, open_backend, parse_args, sgl

LABELS = ["bug report", "feature request", "question", "praise"]

EXAMPLES = [
    ("The app crashes when I upload a file larger than 2 GB.", "bug report"),
    ("Please add a dark mode to the settings page.", "feature request"),
    ("How do I export my data to CSV?", "question"),
    ("Fantastic update, everything feels much faster now!", "praise"),
    ("Clicking 'save' twice creates duplicate entries.", "bug report"),
    ("It would be great to schedule reports weekly.", "feature request"),
    ("Is there a limit on the number of projects?", "question"),
    ("Thanks for the quick support, you saved my day.", "praise"),
]

MESSAGES = [
    "The search box ignores accented characters.",
    "Could you support logging in with a security key?",
    "Where can I change my billing address?",
    "I love the new dashboard, great job!",
    "Exports stop at 1000 rows even though I have more.",
    "Can I invite people outside my organization?",
]


@sgl.function
def classify(s, message):
    s += "Classify each customer message as one of: " + ", ".join(LABELS) + ".\n\n"
    for text, label in EXAMPLES:
        s += f"Message: {text}\nLabel: {label}\n\n"
    s += f"Message: {message}\nLabel: "
    s += sgl.select("label", choices=LABELS)


def main() -> None:
    args = parse_args("Classify messages with a few-shot prompt and select.")
    with open_backend(args) as backend:
        hits = HitRate(backend)
        t0 = time.perf_counter()
        states = classify.run_batch([{"message": m} for m in MESSAGES], backend=backend)
        for m, st in zip(MESSAGES, states):
            scores = st.get_meta_info("label")["normalized_prompt_logprobs"]
            shown = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
            print(f"{st['label']:>15} <- {m}   ({shown})")
        print(f"\n{len(MESSAGES)} messages in {time.perf_counter() - t0:.1f} s; {hits.report()}")


if __name__ == "__main__":
    main()
