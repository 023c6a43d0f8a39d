"""Role segments cut out of the model's chat template.

A role's segment is the text the template puts around one message's content. It is found by rendering a message whose
content is a sentinel and splitting at the sentinel, in two positions: as the conversation's first message (which
carries what a template puts at the start: BOS, a default system prompt) and after earlier messages. For templates that
render each message on its own (ChatML/Qwen, Llama 3, ...), concatenating the segments of a conversation equals the
template's rendering of the whole conversation, so `s += user(...)` builds exactly the prompt `Engine.chat` would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
SENTINEL = "<<frontend-dsl-content>>"

# Earlier messages after which each role may follow (templates that enforce user/assistant alternation accept these).
_LATER_CONTEXT: dict[str, list[dict[str, str]]] = {
    "system": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
    "user": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
    "assistant": [{"role": "user", "content": "A"}],
}

Render = Callable[[list[dict[str, str]]], str]  # messages -> text, without a generation prompt


@dataclass(frozen=True)
class RoleSegment:
    prefix: str
    suffix: str


def _cut(render: Render, context: list[dict[str, str]], role: str) -> RoleSegment | str:
    """The segment of a `role` message appended after `context`, or a reason why the template has none."""
    where = "as the first message" if not context else f"after {'/'.join(m['role'] for m in context)}"
    try:
        before = render(context) if context else ""
        after = render([*context, {"role": role, "content": SENTINEL}])
    except ValueError as e:
        return f"the chat template does not accept a {role} message {where}: {e}"
    if not after.startswith(before):
        return f"the chat template re-renders earlier messages when a {role} message follows them"
    seg = after[len(before) :]
    if seg.count(SENTINEL) != 1:
        return f"the chat template does not render a {role} message's content verbatim"
    prefix, suffix = seg.split(SENTINEL)
    return RoleSegment(prefix, suffix)


class RoleTemplates:
    """Prefix/suffix text of each role, first in the conversation or later, computed once per backend."""

    def __init__(self, render: Render) -> None:
        self.first: dict[str, RoleSegment | str] = {r: _cut(render, [], r) for r in ROLES}
        self.later: dict[str, RoleSegment | str] = {r: _cut(render, _LATER_CONTEXT[r], r) for r in ROLES}

    def segment(self, role: str, first: bool) -> RoleSegment:
        """The segment for `role`; ValueError if the role is unknown or the template cannot place it there."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        seg = (self.first if first else self.later)[role]
        if isinstance(seg, str):
            raise ValueError(seg)
        return seg
