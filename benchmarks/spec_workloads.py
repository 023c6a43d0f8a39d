"""The workloads of the speculative-decoding benchmarks (benchmarks/speculative.py in process, and
benchmarks/speculative_http.py through HTTP servers): chat messages and sampling parameters, so the same requests go
to an Engine, to radixserve's server and to llama-server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FUNCTION = '''def merge_intervals(intervals, min_gap=0, keep_labels=False):
    """Merge overlapping [start, end, label] intervals; gaps up to min_gap are bridged."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda item: (item[0], item[1]))
    merged = []
    current_start, current_end, current_label = ordered[0][0], ordered[0][1], ordered[0][2]
    for start, end, label in ordered[1:]:
        if start <= current_end + min_gap:
            current_end = max(current_end, end)
            if keep_labels and label not in current_label.split("+"):
                current_label = current_label + "+" + label
        else:
            merged.append((current_start, current_end, current_label))
            current_start, current_end, current_label = start, end, label
    merged.append((current_start, current_end, current_label))
    total = sum(end - start for start, end, _ in merged)
    longest = max(merged, key=lambda item: item[1] - item[0])
    print(f"merged {len(intervals)} intervals into {len(merged)}; covered {total}; longest {longest}")
    return merged
'''

DOCUMENT = (
    "The Riverside Library opens at 9 a.m. on weekdays and at 10 a.m. on Saturdays; it is closed on Sundays and "
    "public holidays. Members may borrow up to twelve items at a time, of which no more than four may be DVDs. "
    "Books are lent for three weeks and may be renewed twice online, unless another member has reserved them. "
    "Late returns cost 20 cents per item per day, capped at 6 dollars per item. Lost items are charged at their "
    "replacement cost plus a 5 dollar processing fee. The study rooms on the second floor can be booked for up to "
    "two hours per day through the library website, and bookings open seven days in advance. Printing costs 10 "
    "cents per black-and-white page and 50 cents per colour page; scanning is free. Children under twelve must be "
    "accompanied by an adult after 6 p.m. The library's wifi network is called RiversideGuest and needs no password."
)

# Open-ended requests on unrelated subjects: the prompt holds nothing the answer would copy.
PROSE_TOPICS = [
    "Describe a walk through a night market in a city you invent.",
    "Write a letter from a retired sailor to his granddaughter about the first storm he lived through.",
    "Tell the story of how a mountain village chose where to dig its new well.",
    "Write a fable about a crow who learns to count.",
    "Describe the first warm morning of spring in a small harbour town.",
    "Write a diary entry of a violinist on the day before her first concert.",
]

GREEDY: dict[str, Any] = {"temperature": 0}
MODEL_DEFAULTS: dict[str, Any] = {}  # temperature, top_p, top_k and repetition penalty left to the model's defaults
# What the default model's defaults are (radixserve/model/sampling_defaults.py), spelled out for llama-server.
QWEN_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repeat_penalty": 1.1}

Messages = list[dict[str, str]]


@dataclass
class Workload:
    name: str
    requests: list[Messages]  # one chat per request, sent one after another (one stream)
    max_new: int
    params: dict[str, Any] = field(default_factory=dict)  # sampling parameters beyond max_new_tokens

    @property
    def sampled(self) -> bool:
        return self.params.get("temperature", 1.0) != 0


def code_edit() -> Messages:
    return [
        {
            "role": "user",
            "content": "Here is a Python function:\n\n```python\n" + FUNCTION + "```\n\n"
            "Rewrite the whole function with one change: rename the parameter `min_gap` to `max_gap`. "
            "Output only the complete code.",
        }
    ]


FIRST_TURN: Messages = [
    {
        "role": "user",
        "content": "Write a Python class `LRUCache` with get and put methods, using an OrderedDict. Only code.",
    }
]


def multi_turn(first_answer: str) -> Messages:
    return FIRST_TURN + [
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "Add a docstring to every method and show the full class again."},
    ]


def rag() -> Messages:
    return [
        {"role": "system", "content": "Answer from the document only, quoting its sentences."},
        {
            "role": "user",
            "content": "Document:\n" + DOCUMENT + "\n\nWhat are the rules for borrowing, "
            "renewing and returning items late? Quote every relevant sentence.",
        },
    ]


def workloads(first_answer: Callable[[Messages], str]) -> list[Workload]:
    """Every workload; `first_answer` answers FIRST_TURN greedily (200 tokens) for the multi-turn one."""
    prose = [[{"role": "user", "content": t}] for t in PROSE_TOPICS]
    return [
        Workload("code-edit", [code_edit()], 400, GREEDY),
        Workload("multi-turn", [multi_turn(first_answer(FIRST_TURN))], 300, GREEDY),
        Workload("rag", [rag()], 200, GREEDY),
        Workload("prose-sampled", prose, 160, MODEL_DEFAULTS),
        Workload("prose-greedy", prose, 160, GREEDY),
    ]


def repeated_share(ids: list[int], n: int = 4) -> float:
    """Share of the answer's n-grams that already occurred earlier in it: how much a loop repeats itself (an answer
    with nothing to copy scores near 0; the 0.5B model's greedy loops score 0.5 and more)."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0
