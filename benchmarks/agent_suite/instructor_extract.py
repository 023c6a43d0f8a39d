"""instructor on the openai SDK, as its docs extract typed data: a `response_model` through tool calls (its
default mode), a nested model, a list of models (`Iterable`), JSON mode, and partial objects streamed as they
fill. Its retries (max_retries=1) send a validation error back once, as its users rely on."""

from __future__ import annotations

from collections.abc import Iterable

import instructor
from openai import OpenAI
from pydantic import BaseModel

from benchmarks.agent_suite.outcome import expect
from benchmarks.agent_suite.scenarios import MAX_TOKENS, MODEL, scenario

LIB = "instructor"


def _client(url: str, mode: instructor.Mode = instructor.Mode.TOOLS) -> instructor.Instructor:
    return instructor.from_openai(OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600), mode=mode)


def _extract(url: str, model: type, text: str, mode: instructor.Mode = instructor.Mode.TOOLS) -> object:
    return _client(url, mode).chat.completions.create(
        model=MODEL,
        response_model=model,
        messages=[{"role": "user", "content": f"Extract from: {text}"}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=1,
    )


class User(BaseModel):
    name: str
    age: int


@scenario(LIB)
def tools_mode(url: str) -> None:
    user = _extract(url, User, "Jason is 25 years old.")
    expect(isinstance(user, User) and user.age == 25 and "jason" in user.name.lower(), f"got {user!r}")


class Address(BaseModel):
    street: str
    city: str


class Customer(BaseModel):
    name: str
    address: Address


@scenario(LIB)
def nested_model(url: str) -> None:
    c = _extract(url, Customer, "Grace Hopper lives at 12 Navy Road, Arlington.")
    expect(isinstance(c, Customer) and "arlington" in c.address.city.lower(), f"got {c!r}")


@scenario(LIB)
def iterable_models(url: str) -> None:
    """`Iterable[User]` asks for several objects in one answer (a wrapper tool whose schema holds the list)."""
    users = list(_extract(url, Iterable[User], "Ana is 31 and Ben is 42."))  # type: ignore[arg-type]
    ages = sorted(u.age for u in users)
    expect(ages == [31, 42], f"got {users!r}")


@scenario(LIB)
def json_mode(url: str) -> None:
    user = _extract(url, User, "Maria, aged 58, signed the form.", instructor.Mode.JSON)
    expect(isinstance(user, User) and user.age == 58, f"got {user!r}")


@scenario(LIB)
def partial_stream(url: str) -> None:
    """`create_partial` streams the tool call and yields the object as it fills in."""
    stream = _client(url).chat.completions.create_partial(
        model=MODEL,
        response_model=User,
        messages=[{"role": "user", "content": "Extract from: Kim is 19 years old."}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    partials = list(stream)
    expect(partials, "no partial object streamed")
    last = partials[-1]
    expect(last.age == 19 and last.name, f"last partial {last!r}")
