"""The workloads, as sessions for the replay client, at three sizes (smoke: tiny model in CI; quick; full).

Texts are built from a seeded word list and sized in tokens with the model's own tokenizer, so every engine gets
byte-identical prompts and every run the same ones.
  multiturn: conversations sharing one long system prompt; each turn a new user message, the answer written back.
  rag: a few long documents, many short questions per document, interleaved across documents, sent concurrently.
  nosharing: distinct random completion prompts (no chat template: even its default system text would be shared).
  fork: the branch-solve-merge program of examples/, recorded on radixserve and replayed (see fork.py).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from benchmarks.compare.client import Session, Step

WORDS = (
    "cache page token prefix tree node request batch decode prefill kernel thread queue budget memory latency "
    "throughput scheduler policy eviction lock parent child hash key value layer head model weight tensor shape "
    "stride buffer index offset chunk stream socket client server route header body status error retry timeout "
    "deadline signal process worker pool lease slot order shard replica leader follower commit log snapshot "
    "checkpoint restore compile build test assert verify measure profile trace sample window bucket counter "
    "gauge metric alert owner review branch merge rebase patch diff release version schema field record column "
    "table query plan join filter sort limit cursor page_size region zone disk file folder path mount volume "
    "careful simple honest quick slow stable fresh stale small large exact rough"
).split()


@dataclass(frozen=True)
class Size:
    """How big each workload is; the full size makes each engine's run take minutes on the 2-core machine."""

    conversations: int = 8
    conversation_concurrency: int = 4
    turns: int = 4
    system_tokens: int = 1000
    user_tokens: int = 64
    answer_tokens: tuple[int, ...] = (32, 48, 64, 48)  # per turn, cycled
    documents: int = 3
    questions_per_document: int = 8
    document_tokens: int = 1500
    question_tokens: int = 24
    rag_answer_tokens: int = 32
    rag_concurrency: int = 4
    nosharing_prompts: int = 24
    nosharing_tokens: int = 512
    nosharing_answer_tokens: int = 32
    nosharing_concurrency: int = 4
    fork_tasks: int = 4
    fork_concurrency: int = 2
    micro_prefill_tokens: int = 512
    micro_prefill_repeats: int = 3
    micro_decode_tokens: int = 64
    micro_batches: tuple[int, ...] = (1, 4, 16)
    # llama-server's slots (-np) in micro: 0 = the largest batch, every stream in a slot; fewer queue the rest (the
    # issue 38 text's reference run had -np 4 beside eight streams)
    micro_llama_slots: int = 0


SIZES = {
    "full": Size(),
    "quick": Size(
        conversations=4,
        turns=3,
        system_tokens=1000,
        documents=2,
        questions_per_document=4,
        nosharing_prompts=8,
        fork_tasks=2,
        micro_prefill_repeats=1,
        micro_decode_tokens=32,
    ),
    "smoke": Size(
        conversations=2,
        conversation_concurrency=2,
        turns=2,
        system_tokens=96,
        user_tokens=16,
        answer_tokens=(8, 6),
        documents=2,
        questions_per_document=2,
        document_tokens=128,
        question_tokens=12,
        rag_answer_tokens=6,
        rag_concurrency=2,
        nosharing_prompts=3,
        nosharing_tokens=48,
        nosharing_answer_tokens=6,
        nosharing_concurrency=2,
        fork_tasks=1,
        fork_concurrency=1,
        micro_prefill_tokens=64,
        micro_prefill_repeats=1,
        micro_decode_tokens=8,
        micro_batches=(1, 4),
    ),
}


def llama_slots(size: Size) -> int:
    """llama-server's slots (-np) for the micro workload: micro_llama_slots, else the largest batch."""
    return size.micro_llama_slots or max(size.micro_batches)


def resize(size: Size, overrides: list[str]) -> Size:
    """size with FIELD=VALUE overrides applied (integers, or comma-separated integers for tuple fields)."""
    changes: dict[str, object] = {}
    for item in overrides:
        name, _, value = item.partition("=")
        current = getattr(size, name, None)
        if current is None or not value:
            raise ValueError(
                f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(Size.__annotations__)}"
            )
        changes[name] = tuple(int(v) for v in value.split(",")) if isinstance(current, tuple) else int(value)
    return dataclasses.replace(size, **changes)


class TextMaker:
    """Seeded pseudo-English text of a given length in tokens, for one tokenizer."""

    def __init__(self, tokenizer: object, seed: int) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)

    def sentence(self) -> str:
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(6, 14))]
        return " ".join(words).capitalize() + "."

    def text(self, tokens: int, lead: str = "") -> str:
        """Whole sentences after `lead` until the text is at least `tokens` tokens long."""
        out = lead
        while len(self.tok.encode(out)) < tokens:  # type: ignore[attr-defined]
            out += (" " if out else "") + self.sentence()
        return out


def multiturn(tok: object, size: Size) -> tuple[list[Session], int]:
    """Conversations sharing one system prompt; returns (sessions, concurrency)."""
    mk = TextMaker(tok, seed=1)
    system = mk.text(size.system_tokens, "You are the on-call assistant of a storage team. House rules follow.")
    sessions = []
    for c in range(size.conversations):
        stages = [
            [
                Step(
                    size.answer_tokens[t % len(size.answer_tokens)],
                    user=mk.text(size.user_tokens, f"Question {t + 1} of user {c + 1}:"),
                    tag=f"turn {t + 1}",
                )
            ]
            for t in range(size.turns)
        ]
        sessions.append(Session(stages, system=system))
    return sessions, size.conversation_concurrency


def rag(tok: object, size: Size) -> tuple[list[Session], int]:
    """One single-turn chat per question: system + document, then the question; questions interleave documents."""
    mk = TextMaker(tok, seed=2)
    docs = [mk.text(size.document_tokens, f"Document {d + 1}.") for d in range(size.documents)]
    sessions = []
    for q in range(size.questions_per_document):
        for d, doc in enumerate(docs):
            system = "Answer the question from this document only.\n\n" + doc
            user = mk.text(size.question_tokens, f"Question {q + 1}:")
            sessions.append(Session([[Step(size.rag_answer_tokens, user=user, tag=f"doc {d + 1}")]], system=system))
    return sessions, size.rag_concurrency


def nosharing(tok: object, size: Size) -> tuple[list[Session], int]:
    """Distinct random completion prompts: any two share at most a few leading tokens (less than one KV page)."""
    mk = TextMaker(tok, seed=3)
    sessions = [
        Session(
            [
                [
                    Step(
                        size.nosharing_answer_tokens,
                        prompt=mk.text(size.nosharing_tokens, f"{7919 * (i + 3)}."),
                        tag="prompt",
                    )
                ]
            ]
        )
        for i in range(size.nosharing_prompts)
    ]
    return sessions, size.nosharing_concurrency


def distinct_prompts(tok: object, n: int, tokens: int, seed: int) -> list[str]:
    """n distinct completion prompts of about `tokens` tokens (for the micro-benchmark)."""
    mk = TextMaker(tok, seed=seed)
    return [mk.text(tokens, f"{104729 * (i + 1) + seed}.") for i in range(n)]
