"""Finding JSON in free text as it streams: whether an object opens as a tool call, and where an object or array
ends, read from its brackets and strings alone (the text after it may not have arrived, so no parser can be run on
the whole yet)."""

from __future__ import annotations


def json_head(text: str) -> bool | None:
    """Whether text that starts with "{" opens a call object (`{"name": "`, whitespace allowed between, as the lazy
    grammar's trigger in tool_grammar.py), None while it cannot yet tell."""
    rest = text[1:]
    for piece in ('"name"', ":", '"'):
        rest = rest.lstrip(" \t\n")
        if not rest:
            return None
        if not rest.startswith(piece):
            return None if piece.startswith(rest) else False
        rest = rest[len(piece) :]
    return True


def value_end(text: str) -> int | None:
    """The index just past the JSON object or array that opens text (at "{" or "["), by its brackets outside
    strings; None while it has not closed."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
