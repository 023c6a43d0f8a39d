"""A multi-turn chat loop: each turn re-sends the conversation, whose earlier turns are already in the cache.

    python examples/multi_turn_chat.py [--model PATH | --url URL] [--interactive]

Without --interactive it plays a short scripted conversation.
"""

from __future__ import annotations

import time

from common import HitRate, open_backend, parse_args, sgl

SCRIPT = [
    "I want to learn Python. What should I start with?",
    "How do I read a text file line by line?",
    "And how do I count the words in it?",
    "Put that together into one short script.",
]


@sgl.function
def chat_turn(s, history, message):
    s += sgl.system("You are a friendly Python tutor. Keep answers short.")
    for m in history:  # the earlier turns render to the same text as last time: a cache hit
        s += sgl.user(m["content"]) if m["role"] == "user" else sgl.assistant(m["content"])
    s += sgl.user(message)
    s += sgl.assistant(sgl.gen("reply", max_tokens=96))


def main() -> None:
    args = parse_args(
        "Chat with the model; earlier turns are served from the radix cache.",
        {"--interactive": dict(action="store_true", help="type your own messages (empty line ends)")},
    )
    with open_backend(args) as backend:
        hits = HitRate(backend)
        history: list[dict[str, str]] = []
        messages = iter(lambda: input("you> ").strip(), "") if args.interactive else iter(SCRIPT)
        t0 = time.perf_counter()
        for message in messages:
            if not args.interactive:
                print(f"you> {message}")
            state = chat_turn.run(history=history, message=message, backend=backend, temperature=0)
            print(f"bot> {state['reply'].strip()}\n")
            history = state.messages()[1:]  # without the system message, which the program adds itself
        print(f"{len(history) // 2} turns in {time.perf_counter() - t0:.1f} s; {hits.report()}")


if __name__ == "__main__":
    main()
