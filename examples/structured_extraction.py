"""Extraction into a pydantic model: `gen(json_schema=Model)` makes the output parse, whatever the model; a fork then
asks two constrained questions in parallel (a regex and a typed gen) on the same cached prefix.

    python examples/structured_extraction.py [--model PATH | --url http://127.0.0.1:30000]
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from common import HitRate, open_backend, parse_args, sgl


class Item(BaseModel):
    name: str = Field(max_length=24)
    quantity: int = Field(ge=1, le=1000)
    unit_price: float = Field(ge=0, le=100000)


class Invoice(BaseModel):
    vendor: str = Field(max_length=32)
    currency: str = Field(pattern="^(USD|EUR|GBP)$")
    items: list[Item] = Field(max_length=3)
    paid: bool


DOCS = [
    "Invoice 1042 from Acme Tools, dated 2024-03-05, in USD: 3 hammers at 12.5 each and 10 boxes of nails at 4. Paid.",
    "Bill no. 77 issued by Nordic Paper AB on 2023-11-20 (EUR): 500 sheets of A4 paper at 0.02. Not yet paid.",
    "Invoice #5521, Baker Street Books, 2024-01-15, GBP: 2 atlases at 35 and 1 dictionary at 22.99. Paid in full.",
]


@sgl.function
def extract(s, doc):
    s += sgl.system("You extract invoices into JSON.")
    s += sgl.user(f"{doc}\n\nExtract vendor, currency, items and whether it is paid.")
    s += sgl.assistant(sgl.gen("invoice", json_schema=Invoice, max_tokens=400, temperature=0))
    # Two follow-up questions at once, each forked from the conversation so far (its KV is shared in the cache).
    forks = s.fork(2)
    forks[0] += sgl.user("The invoice date, as YYYY-MM-DD?")
    forks[0] += sgl.assistant(sgl.gen("date", regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", max_tokens=16))
    forks[1] += sgl.user("How many items in total?")
    forks[1] += sgl.assistant(sgl.gen_int("count", max_tokens=8))
    forks.join()
    s["date"], s["count"] = forks[0]["date"], forks[1]["count"]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    with open_backend(args) as backend:
        rate = HitRate(backend)
        states = extract.run_batch([{"doc": d} for d in DOCS], backend=backend)
        for state in states:
            invoice = Invoice.model_validate_json(state["invoice"])  # parses: the grammar saw to it
            print(
                f"{invoice.vendor!r} {invoice.currency} paid={invoice.paid} items={len(invoice.items)} "
                f"date={state['date']} count={int(state['count'])}"
            )
        print(rate.report())


if __name__ == "__main__":
    main()
