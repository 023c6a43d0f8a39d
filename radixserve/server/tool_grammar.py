"""Grammars (llguidance's Lark dialect) that hold a model's tool calls to the request's tools.

`required` and a named function: the whole turn is calls. `auto`: a lazy grammar, as llama.cpp's lazy grammars
with trigger words and llguidance's lazy lexemes do it: text is free until the model starts a call, by its own marker
or by a JSON object opening `{"name": "` (the form small models fall back to, bare or in a ```json fence); from
there the rest of the call is held to a declared tool's name and that tool's parameter schema, so every call that
starts is valid JSON for a declared tool. Markers that are single tokens in the vocabulary are named by id, so the
grammar matches the token the model emits, not its spelling.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.constrained.grammar import JSON_OPTIONS
from radixserve.server.tool_calls import ToolFormat

# Free text (any bytes; special tokens are not text, so a marker that is one cannot hide in it).
TEXT = "TEXT: /(.|\\n)*/\n"
THINK_END = "</think>"  # how reasoning models close their block (reasoning.py)
# What starts a JSON call in free text, as the lazy grammar and the parser (json_scan.json_head) both read it.
JSON_TRIGGER = '/\\{[ \\t\\n]*"name"[ \\t\\n]*:[ \\t\\n]*"/'


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}))


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema as its calls are held to it: objects that declare their properties take no
    others unless they say so. JSON Schema allows undeclared ones by default, and the default model then copied the
    schema's own keys into its arguments (`{"city": "Paris", "required": ["city"]}`), which no function accepts;
    llama.cpp's grammars close objects the same way."""
    return closed_objects(fn.get("parameters") or {"type": "object", "properties": {}})


# Where a schema holds other schemas: under a name (each value a schema), or as a schema or list of schemas. Other
# keys (enum, const, default, examples, ...) hold data, which must stay as it is.
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalProperties",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "contains",
)


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema with `properties` and no `additionalProperties` has
    `additionalProperties: false`. An `allOf` is left as it is: closing each branch would refuse the properties
    the others declare."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _NAMED_SCHEMAS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    for key in _SUBSCHEMAS:
        if key in schema:
            out[key] = closed_objects(schema[key])
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema and "allOf" not in schema:
        out["additionalProperties"] = False
    return out


def _wrapped(fns: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The schema of a call object {"name": ..., key: {...}} of any of these functions."""
    schemas = []
    for i, fn in enumerate(fns):
        params = _params(fn)
        # The parameters sit under the wrapper's properties.<key>: their own "#/..." refs ($defs of nested
        # pydantic models, "#" for recursion) must point there, not at the wrapper's root.
        where = f"#/properties/{key}" if len(fns) == 1 else f"#/anyOf/{i}/properties/{key}"
        schemas.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: rebase_refs(params, where)},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _marker(fmt: ToolFormat, text: str) -> str:
    tid = fmt.tokenizer.token_to_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def _after_marker(fmt: ToolFormat, many: bool) -> str:
    """The Lark for what follows the family's marker, `body` being one call object: one call with its end marker,
    a bare object, or (where the family lists its calls) an array of them, of one call unless `many`."""
    family = fmt.family
    if family.listed:
        return '"[" body (", " body)* "]"' if many else '"[" body "]"'
    return f'"\\n" body "\\n" {_marker(fmt, family.end)}' if family.end else "body"


def _calls(fmt: ToolFormat, many: bool) -> str:
    """The Lark for a turn of calls as the family writes them; `many` lets the model write more than one."""
    family = fmt.family
    if family.listed:
        return f"{_marker(fmt, family.start)} {_after_marker(fmt, many)}"
    # Where no end marker closes a call, the model writes the bare object (Llama 3.x's JSON tool calling).
    one = f"{_marker(fmt, family.start)} {_after_marker(fmt, many)}" if family.end else "body"
    # After each complete call the model may end: also after the newline that would begin another one (with the
    # call marker then the only text left, jump-forward would force a next call, and small models went on
    # calling, city after city, until max_tokens).
    return f'call ("\\n" call)* "\\n"?\ncall: {one}' if many else f"call\ncall: {one}"


def call_grammar(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    choice: str | None,
    parallel: bool = True,
    answer: dict | None = None,
) -> str:
    """One call of `choice` (a function name), or of any tool (`choice` None: tool_choice "required"), or several
    with `parallel`; with `answer` (a response_format schema, tool_choice auto) a text answer in it instead."""
    chosen = [t["function"] for t in tools if choice is None or t["function"]["name"] == choice]
    rules = f"calls: {_calls(fmt, choice is None and parallel)}\nbody: {_json(_wrapped(chosen, fmt.family.key))}\n"
    if answer is None:
        return "start: calls\n" + rules
    # `answer`: the schema of a text answer (response_format), applied to that answer only, a call staying open
    return "start: calls | answer\n" + rules + f"answer: {_json(answer)}\n"


def lazy_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """tool_choice auto: free text, in which each call (by the model's marker, or a JSON object that opens with
    `{"name": "`) is held to a declared tool from its first character on."""
    fns = [t["function"] for t in tools]
    key = fmt.family.key
    start, after = _marker(fmt, fmt.start), _after_marker(fmt, parallel)
    if start.startswith("<["):  # a special token: free text cannot spell it, so it needs no lazy head
        tagged = f"TEXT {start} {after}"
    else:
        tagged = f"tag_head {after}\ntag_head[lazy]: TEXT {start}"
    # After the trigger `{"name": "`: a declared name, then that tool's arguments (the parser also reads the other
    # key, but the grammar holds the model to its family's).
    tails = " | ".join(f"json_{i}" for i in range(len(fns)))
    per_tool = ""
    for i, fn in enumerate(fns):
        rest_of_name = json.dumps(f'{fn["name"]}", "{key}": ')  # the name's closing quote, the arguments' key
        per_tool += f'json_{i}: {rest_of_name} args_{i} "}}"\nargs_{i}: {_json(_params(fn))}\n'
    many = "*" if parallel else "?"
    return (
        f"start: (tagged | bare){many} TEXT\n{TEXT}tagged: {tagged}\nbody: {_json(_wrapped(fns, key))}\n"
        f"bare: json_head ({tails})\njson_head[lazy]: TEXT {JSON_TRIGGER}\n{per_tool}"
    )


def answer_grammar() -> str:
    """A text answer that starts no call: its first character cannot open a marker, a JSON object (bare or in
    parentheses), an array or a fence, and a marker that is one special token is no text at all. For a turn that
    only repeated calls already answered, continued after them (call_stop.answer_after_echo)."""
    return "start: ANSWER\nANSWER: /[^ \\t\\n{\\[(<`](.|\\n)*/\n"


def after_reasoning(grammar: str, fmt: ToolFormat) -> str:
    """`grammar` (one of call_grammar's), after the reasoning block the prompt opened: free text until the model
    closes it (with its `</think>`, a token of its own where the vocabulary has one), then blank space."""
    assert grammar.startswith("start: "), grammar[:40]
    end = _marker(fmt, THINK_END)
    thought = f"thought: THOUGHT {end}" if end.startswith("<[") else f"thought[lazy]: THOUGHT {end}"
    rules = f"{thought}\nTHOUGHT: /(.|\\n)*/\nGAP: /[ \\t\\n]*/\n"
    head, rest = grammar.split("\n", 1)
    return f"start: thought GAP ({head[len('start: ') :]})\n{rules}{rest}"


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#", "#/$defs/X", ...) are resolved from `base` (a JSON pointer
    fragment where the schema is embedded in a larger document) instead of the document's root."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out
