"""Grammars built to cost a grammar engine as much as possible (issue 33): counted regexes, nested quantifiers, deep
and wide schemas, huge enums and alternations, right recursion. (field, source) by name; the tests and
benchmarks/grammar_stall.py send each and expect a 200 or a 400 naming the field, in bounded time."""

from __future__ import annotations

from typing import Any


def _nested_object(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


BOMBS: dict[str, tuple[str, Any]] = {
    "counted-regex": ("regex", "(a|b){2000}[a-z]{20000}"),
    "counted-nested": ("regex", "((a{50}){50}){50}"),
    "counted-wide-class": ("regex", "[a-z0-9 ]{1,100000}"),
    "nested-quantifiers": ("regex", "(((a*)*)*)*b|((x+x+)+y)+"),
    "regex-alternation-20000": ("regex", "|".join(f"w{i}" for i in range(20000))),
    "ebnf-alternation-20000": ("ebnf", "root ::= " + " | ".join(f'"w{i}"' for i in range(20000))),
    "ebnf-right-recursion-2000": ("ebnf", "root ::= " + " | ".join(f'"{i}" root' for i in range(2000)) + ' | ""'),
    "ebnf-deep-parentheses": ("ebnf", "root ::= " + "(" * 400 + '"a"' + ")" * 400),
    "schema-enum-20000": ("json_schema", {"enum": [f"v{i}" for i in range(20000)]}),
    "schema-anyOf-3000": (
        "json_schema",
        {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                for i in range(3000)
            ]
        },
    ),
    "schema-deep-200": ("json_schema", _nested_object(200)),
    "schema-wide-3000": (
        "json_schema",
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
            "required": [f"p{i}" for i in range(3000)],
        },
    ),
    "schema-pattern-counted": ("json_schema", {"type": "string", "pattern": "^(a|b){1000}[0-9]{5000}$"}),
}

# Passes the checks made before queueing (its wide row comes only after a run of letters and a dot), then fails.
FAILS_LATER = 'root ::= [a-y]{4,6} "." tail\ntail ::= ' + " | ".join(f'"{i}" tail' for i in range(2000)) + ' | ""'
