"""Executor: runs one program state's expressions in order on a worker thread.

`s += gen(...)` only queues the expression, so the Python program (and each of its forks) goes on while the model
works; reading `s["x"]` waits only until every queued write to "x" is done. The worker thread lives while there is
queued work and exits when the queue is empty, so a state that is dropped holds no thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from frontend_dsl.backends.base import Backend
from frontend_dsl.ir import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    written_vars,
)
from frontend_dsl.global_config import global_config
from frontend_dsl.prefix_gate import GateTicket

_LOGPROB_ARGS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_STREAM_LISTS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
)  # a stream chunk holds only its own entries


class Executor:
    def __init__(
        self,
        backend: Backend,
        defaults: dict[str, Any],
        stream: bool,
        ticket: GateTicket | None = None,
        fed_async: bool = False,
    ) -> None:
        """`defaults`: run()'s sampling args (engine names). `fed_async`: a program thread may still append, so a
        text iterator must also wait for end() before it stops."""
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.ticket = ticket
        self.text_ = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, dict[str, Any]] = {}
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        self.error: BaseException | None = None
        # (variable or None, text, that gen's meta_info so far or None) in the order text was appended
        self.chunks: list[tuple[str | None, str, dict[str, Any] | None]] = []
        self.fork_start = 0  # len(text_) when this state was forked off its parent
        self.var_scopes: dict[str, int] = {}  # open var_scope name -> where its text begins
        self.ended = not fed_async
        self._pending: dict[str, int] = {}
        self._queue: deque[Expr] = deque()
        self._busy = False
        self._cond = threading.Condition()

    # ---- caller side ------------------------------------------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        """Queue expr after everything queued before it."""
        with self._cond:
            if self.error is not None:
                return  # the state already failed; run() reports the first error
            for name in written_vars(expr):
                self._pending[name] = self._pending.get(name, 0) + 1
            self._queue.append(expr)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._work, name="frontend_dsl-executor", daemon=True).start()

    def wait_idle(self) -> None:
        """Wait until every queued expression ran (or the state failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)

    def get_var(self, name: str) -> Any:
        """The variable's value once its queued writes are done; re-raises the state's error if it failed first."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending.get(name, 0) == 0 or self.error is not None)
            if name in self.variables and self._pending.get(name, 0) == 0:
                return self.variables[name]
            if self.error is not None:
                raise self.error
            raise KeyError(f"no variable {name!r} in this state (variables: {sorted(self.variables)})")

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        self.get_var(name)
        return self.meta_info.get(name)

    def fail(self, error: BaseException, replace: bool = False) -> None:
        """Record an error raised outside the worker (the program function itself); the first one wins unless replace."""
        with self._cond:
            if self.error is None or replace:
                self.error = error
            self._queue.clear()
            self._cond.notify_all()

    def end(self) -> None:
        """The program function returned: no more appends come, so text iterators may stop once idle."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def fork(self, n: int) -> list["Executor"]:
        """n copies of this state after its queued work; the shared text is prefilled once so the copies hit it."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork size must be an integer >= 1, got {n!r}")
        self.wait_idle()
        if self.error is not None:
            raise self.error
        if n > 1 and self.text_:
            self._backend_call_gate(self.text_)
            self.backend.prefill(self.text_)
        children = []
        for _ in range(n):
            c = Executor(self.backend, self.defaults, self.stream, self.ticket)
            c.text_ = self.text_
            c.variables = dict(self.variables)
            c.meta_info = dict(self.meta_info)
            c.messages_ = [dict(m) for m in self.messages_]
            c.cur_role, c.cur_role_begin = self.cur_role, self.cur_role_begin
            c.fork_start, c.var_scopes = len(self.text_), dict(self.var_scopes)
            children.append(c)
        return children

    def text_iter(
        self, var_name: str | None = None, with_meta: bool = False
    ) -> Iterator[str | tuple[str, dict[str, Any] | None]]:
        """Text as it is appended (only variable var_name's text if given) until the state is done; then raises its
        error. with_meta: (text, meta_info of the gen or select that wrote it, as far as it is known) pairs."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.chunks) > i or self._done())
                new = self.chunks[i:]
                i = len(self.chunks)
                done = self._done()
            for var, text, meta in new:
                if var_name is None or var == var_name:
                    yield (text, meta) if with_meta else text
            if done:
                break
        if self.error is not None:
            raise self.error

    def _done(self) -> bool:
        # A state fed by a program thread is done only once that thread ended it (it also turns a failure into the
        # ProgramError that text_iter raises).
        return self.ended and (not self._busy or self.error is not None)

    # ---- worker side ------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                for node in flatten(expr):
                    self._execute(node)
            except BaseException as e:  # the error is the state's result; readers and run() re-raise it
                with self._cond:
                    if self.error is None:
                        self.error = e
                    self._queue.clear()
                    self._busy = False
                    self._cond.notify_all()
                return

    def _execute(self, node: Expr) -> None:
        if isinstance(node, Text):
            self._append(node.value, None)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, RoleBegin):
            self._role_begin(node.role)
        elif isinstance(node, RoleEnd):
            self._role_end(node.role)
        elif isinstance(node, SetVar):
            self._set(node.name, node.value, None)
        elif isinstance(node, VarScopeBegin):
            self.var_scopes[node.name] = len(self.text_)
        elif isinstance(node, VarScopeEnd):
            if node.name not in self.var_scopes:
                raise ValueError(f"var_scope {node.name!r} ended without beginning")
            self._set(node.name, self.text_[self.var_scopes.pop(node.name) :], None)
        else:
            raise TypeError(f"cannot execute {type(node).__name__}")

    def _append(self, text: str, var: str | None, meta: dict[str, Any] | None = None) -> None:
        if not text:
            return
        with self._cond:
            self.text_ += text
            self.chunks.append((var, text, meta))
            self._cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: dict[str, Any] | None) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self._pending[name] -= 1
            self._cond.notify_all()

    def _backend_call_gate(self, prompt: str) -> None:
        if self.ticket is not None:
            self.ticket.arrive(prompt)

    def _prompt(self) -> str | list[dict[str, str]]:
        """The text so far, or for a chat-only backend (an OpenAI chat model) the messages so far, which it can
        continue only with a new assistant message: so the gen must open that message."""
        if not getattr(self.backend, "chat_only", False):
            return self.text_
        if self.cur_role != "assistant" or len(self.text_) != self.cur_role_begin:
            raise ValueError(
                f"{self.backend!r} is a chat model: a gen must come right after sgl.assistant / "
                "assistant_begin (the model only writes whole assistant messages)"
            )
        return [dict(m) for m in self.messages_]

    def _gen(self, node: Gen) -> None:
        merged = {**global_config.output_params(), **self.defaults, **node.params}
        params = {k: v for k, v in merged.items() if v is not None}
        logprob_args = {k: params.pop(k) for k in _LOGPROB_ARGS if k in params}
        prompt = self._prompt()
        self._backend_call_gate(self.text_)
        if self.stream:
            value, meta = "", {}
            whole: dict[str, list[Any]] = {k: [] for k in _STREAM_LISTS}  # the gen's output logprobs so far
            unsent: dict[str, list[Any]] = {k: [] for k in _STREAM_LISTS}  # of chunks without text (not appended)
            for chunk in self.backend.generate_stream(prompt, params, **logprob_args):
                meta = dict(chunk["meta_info"])
                for key in _STREAM_LISTS:
                    if key in meta:  # a chunk's text comes with the logprobs of its own tokens, as in SGLang
                        whole[key] += meta[key]
                        unsent[key] += meta[key]
                        if chunk["text"]:
                            meta[key], unsent[key] = unsent[key], []
                self._append(chunk["text"], node.name, meta)
                value += chunk["text"]
            meta = meta | {k: v for k, v in whole.items() if k in meta}  # a new dict: the last chunk keeps its own
        else:
            out = self.backend.generate(text=prompt, sampling_params=params, **logprob_args)
            value, meta = out["text"], out["meta_info"]
            self._append(value, node.name, meta)
        self._set(node.name, value, meta)

    def _select(self, node: Select) -> None:
        self._backend_call_gate(self.text_)
        method = node.choices_method
        scores = self.backend.score_choices(
            self.text_, node.choices, getattr(method, "requires_unconditional_logprobs", False)
        )
        decision = method(choices=node.choices, **scores)
        if decision.decision not in node.choices:
            raise ValueError(f"choices_method {method!r} decided {decision.decision!r}, not one of the choices")
        self._append(decision.decision, node.name, decision.meta_info)
        self._set(node.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"cannot begin a {role} message inside an open {self.cur_role} message")
        seg = self.backend.role_templates().segment(role, first=not self.messages_)
        self._append(seg.prefix, None)
        self.cur_role, self.cur_role_begin = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without a matching {role}_begin() (open message: {self.cur_role})")
        content = self.text_[self.cur_role_begin :]
        seg = self.backend.role_templates().segment(role, first=not self.messages_)
        self._append(seg.suffix, None)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
