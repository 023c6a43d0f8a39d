"""RAG: one long system prompt (retrieved documents) answers several questions; the documents are computed once.

    python examples/rag.py [--model PATH | --url http://127.0.0.1:30000]

run_batch sends the questions together; their common prefix (the system prompt with the documents) is prefilled
once, and every question's prompt then starts with cached pages.
"""

from __future__ import annotations

import time

from common import HitRate, open_backend, parse_args, sgl

DOCUMENTS = """\
[doc 1] Harbor Lane Library opens at 9:00 on weekdays and at 10:00 on Saturdays. It is closed on Sundays and on
public holidays. During the summer months (June to August) it closes at 18:00 instead of 20:00. The reading room on
the second floor is a quiet zone: phones must be on silent and calls must be taken in the lobby.

[doc 2] Membership is free for residents of the city. Non-residents pay 25 euros per year. A membership card is
issued at the front desk on presentation of an identity document and a proof of address no older than three months.
Children under 12 need a parent or guardian to sign the application form. Lost cards are replaced for 3 euros.

[doc 3] Members may borrow up to 8 items at a time: at most 6 books, 2 DVDs and 1 board game. Books are lent for
three weeks, DVDs for one week and board games for two weeks. A loan can be renewed twice online or at the desk,
unless another member has reserved the item. Late returns cost 20 cents per item per day, capped at 5 euros per item.

[doc 4] The library has 12 public computers on the ground floor, bookable in one-hour slots, at most two slots per
day per member. Printing costs 10 cents per black-and-white page and 50 cents per color page. The wireless network
"HarborLane-Public" needs no password; it is filtered and limited to 10 megabits per second per device.

[doc 5] The makerspace in the basement has two 3D printers, a laser cutter and a sewing machine. Members must attend
a free 45-minute safety session before using the laser cutter. Sessions run every Wednesday at 17:00 and every
Saturday at 11:00; registration is at the front desk. 3D printing material costs 5 cents per gram.

[doc 6] Events: story time for children aged 3 to 6 takes place every Tuesday and Thursday at 10:30. The book club
meets on the first Monday of each month at 19:00 in room B. A language café for English, Spanish and Dutch runs on
Friday evenings from 18:30 to 20:00. All events are free, but the language café asks you to sign up a day ahead.

[doc 7] Accessibility: the main entrance on Harbor Lane has a ramp, and a lift serves all floors. Two reading desks
have adjustable height. Large-print books are on the ground floor next to the audiobook shelves. Guide dogs are
welcome. The library lends two e-readers with text-to-speech for four weeks to members with a visual impairment.

[doc 8] Donations of books published in the last ten years are accepted on Saturdays between 10:00 and 12:00, at
most one box per person. Textbooks, encyclopedias and magazines are not accepted. Donated books that the library does
not keep are sold at the yearly book fair in October; the proceeds fund the children's section.
"""

SYSTEM = (
    "You are the assistant of Harbor Lane Library. Answer the visitor's question in one or two sentences, "
    "using only the documents below. If they do not say, answer that you do not know.\n\n" + DOCUMENTS
)

QUESTIONS = [
    "When does the library open on Saturdays?",
    "How much does a membership cost if I live outside the city?",
    "How long can I keep a DVD?",
    "What do I need to do before using the laser cutter?",
    "Can I bring my guide dog?",
    "When does the book club meet?",
]


@sgl.function
def answer(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=48, stop="\n\n"))


def main() -> None:
    args = parse_args("Answer questions about a long document set with a shared, cached system prompt.")
    with open_backend(args) as backend:
        hits = HitRate(backend)
        t0 = time.perf_counter()
        states = answer.run_batch([{"question": q} for q in QUESTIONS], backend=backend, temperature=0)
        for q, st in zip(QUESTIONS, states):
            print(f"Q: {q}\nA: {st['answer'].strip()}\n")
        print(f"{len(QUESTIONS)} questions in {time.perf_counter() - t0:.1f} s; {hits.report()}")


if __name__ == "__main__":
    main()
