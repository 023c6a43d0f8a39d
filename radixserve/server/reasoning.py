"""A thinking model's reasoning, split from its answer: the text inside `<think>` ... `</think>` (Qwen3, DeepSeek-R1
and the templates that copy them), whole or streamed.

The template may open the block itself (its generation prompt ends with `<think>`), so the output starts inside
it; otherwise the output may open it. Text after `</think>` is the answer, which the tool-call parser then reads.
A model whose template never writes `</think>` has no reasoning: its output is all answer.
"""

from __future__ import annotations

from radixserve.server.tool_calls import partial_suffix
from radixserve.tokenizer import Tokenizer

START, END = "<think>", "</think>"
# --reasoning-parser: "auto" splits reasoning where the chat template writes `</think>`; the named families (whose
# templates may not show it) always split; "none" never does, so the output is all answer.
REASONING_PARSERS = ("auto", "qwen3", "deepseek-r1", "none")


def thinks(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template writes reasoning blocks."""
    template = tokenizer.select_chat_template()
    return isinstance(template, str) and END in template


def opened_by(tokenizer: Tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a reasoning block (the template opened it for the model)."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(START)


def think_split(parser: str, tokenizer: Tokenizer, prompt_ids: object) -> ThinkSplit | None:
    """A fresh splitter for one output of a prompt (its ids), or None when this server splits no reasoning."""
    if parser == "none" or (parser == "auto" and not thinks(tokenizer)):
        return None
    return ThinkSplit(opened_by(tokenizer, prompt_ids) if isinstance(prompt_ids, list) else False)


def pieces(think: ThinkSplit | None, text: str, done: bool) -> list[tuple[str, str]]:
    """A piece of output as ("reasoning" | "content", text) pieces, none empty (`done`: the output has ended)."""
    out = [("content", text)] if think is None else think.feed(text) + (think.finish() if done else [])
    return [p for p in out if p[1]]


class ThinkSplit:
    """Splits text, fed piece by piece, into ("reasoning", text) and ("content", text) pieces. Text that may still
    become a marker is held back until it is known not to be."""

    def __init__(self, inside: bool) -> None:
        self.state = "reasoning" if inside else "start"  # start: the output may yet open a block
        self.buf = ""
        self.closed = False  # a block just ended: the newlines after `</think>` are no answer

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if START.startswith(head):
                return out  # all of it may be the opening marker: wait
            if head.startswith(START):
                self.state, self.buf = "reasoning", head[len(START) :]
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buf.find(END)
            if end < 0:
                cut = len(self.buf) - partial_suffix(self.buf, END)
                out.append(("reasoning", self.buf[:cut]))
                self.buf = self.buf[cut:]
                return [p for p in out if p[1]]
            out.append(("reasoning", self.buf[:end]))
            self.state, self.buf, self.closed = "content", self.buf[end + len(END) :], True
        if self.closed:
            self.buf = self.buf.lstrip("\n")
            self.closed = not self.buf
        out.append(("content", self.buf))
        self.buf = ""
        return [p for p in out if p[1]]

    def finish(self) -> list[tuple[str, str]]:
        """What is held back, once the output has ended (an unclosed block is all reasoning)."""
        rest, self.buf = self.buf, ""
        kind = "reasoning" if self.state == "reasoning" else "content"
        return [(kind, rest)] if rest else []


def split_reasoning(text: str, think: ThinkSplit) -> tuple[str, str]:
    """(reasoning, answer) of a whole output, split by a fresh ThinkSplit."""
    parts = think.feed(text) + think.finish()
    return "".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content")
