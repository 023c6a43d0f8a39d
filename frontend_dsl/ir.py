"""Expression nodes: what `s += ...` appends. A program's executor runs them in order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Typed gens (gen(dtype=...), gen_int, gen_string) as regexes, as SGLang's sglang.lang.ir has them: a number may end
# in spaces or newlines, which SGLang's runtime backend then stops on (api.py adds the stops).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


class Expr:
    """Base of all nodes; `a + b` (either side may be a str) concatenates into one ExprList."""

    def __add__(self, other: Any) -> "ExprList":
        return ExprList([*_items(self), *_items(as_expr(other))])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([*_items(as_expr(other)), *_items(self)])


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class Gen(Expr):
    """Generate into variable `name`; `params` holds only the sampling args this gen sets (engine names)."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Select(Expr):
    """Pick one of `choices` by scoring each as a continuation of the text so far (see choices.py)."""

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Callable[..., Any]


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class SetVar(Expr):
    """`s[name] = value`, kept in order with the program's other expressions."""

    name: str
    value: Any


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """`with s.var_scope(name):` opens here: the text appended until VarScopeEnd becomes variable `name`."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr]


def as_expr(x: Any) -> Expr:
    """A str becomes Text; an Expr passes through; anything else is a TypeError naming what was appended."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(
        f"can only append str or DSL expressions (gen, select, roles) to a program state, got {type(x).__name__}: {x!r}"
    )


def role_message(role: str, expr: Any = None) -> ExprList:
    """A `role` message around expr (None: an empty message)."""
    inner = [] if expr is None else [as_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def _items(e: Expr) -> list[Expr]:
    return e.items if isinstance(e, ExprList) else [e]


def flatten(e: Expr) -> Iterator[Expr]:
    """The leaf nodes of e in execution order."""
    if isinstance(e, ExprList):
        for item in e.items:
            yield from flatten(item)
    else:
        yield e


def written_vars(e: Expr) -> list[str]:
    """Names of the variables that running e sets, in order (repeats kept: each one is a pending write)."""
    return [x.name for x in flatten(e) if isinstance(x, (Gen, Select, SetVar, VarScopeEnd)) and x.name is not None]
