"""ProgramState (`s` in a program) and ProgramStateGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from frontend_dsl.executor import Executor
from frontend_dsl.errors import NotSupportedError
from frontend_dsl.ir import Expr, RoleBegin, RoleEnd, SetVar, Text, VarScopeBegin, VarScopeEnd, as_expr, role_message


class ProgramState:
    """The text, chat messages and variables of a running program; `s += expr` appends, `s[name]` reads."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.ret_value: Any = None  # what the program function returned

    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.executor.submit(as_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.submit(SetVar(name, value))

    def __contains__(self, name: str) -> bool:
        self.executor.wait_idle()
        return name in self.executor.variables

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.submit(SetVar(name, value))

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """The engine's meta_info of the gen that wrote `name` (for a select: the choices' scores)."""
        return self.executor.get_meta_info(name)

    def text(self) -> str:
        """All text so far, once queued work is done (text so far, if the state failed)."""
        self.executor.wait_idle()
        return self.executor.text_

    def messages(self) -> list[dict[str, str]]:
        """The closed role messages so far as [{"role", "content"}]."""
        self.executor.wait_idle()
        return [dict(m) for m in self.executor.messages_]

    def sync(self) -> None:
        """Wait for queued work; raise the state's error if it failed."""
        self.executor.wait_idle()
        if self.executor.error is not None:
            raise self.executor.error

    def error(self) -> BaseException | None:
        self.executor.wait_idle()
        return self.executor.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text pieces as they are produced (with run(stream=True), gen output token by token); var_name: only that gen's."""
        return self.executor.text_iter(var_name)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[str | tuple[str, Any]]:
        """text_iter for asyncio code: the waiting happens on a worker thread, so the event loop keeps running.
        return_meta_data: (text, meta_info of the gen that wrote it so far) pairs, as SGLang gives them."""
        loop = asyncio.get_running_loop()
        pieces = self.executor.text_iter(var_name, with_meta=return_meta_data)
        done = object()
        while (piece := await loop.run_in_executor(None, next, pieces, done)) is not done:
            yield piece

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"): s += ...` sets variable x to the text appended inside the block."""
        self.executor.submit(VarScopeBegin(name))
        yield
        self.executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        """`size` independent copies of this state that run concurrently; the shared prefix is computed once."""
        if position_ids_offset is not None:
            raise NotSupportedError(
                "fork(position_ids_offset=...) is not supported: radixserve positions every "
                "token by its place in the text"
            )
        return ProgramStateGroup([ProgramState(e) for e in self.executor.fork(size)], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator["ProgramState"]:
        """A single fork, joined back (its new variables gathered) when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += role_message(role, expr)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(RoleBegin(role))
        yield
        self.executor.submit(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` appends a system message; `with s.system(): ...` wraps what the block appends."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states of one fork: index or iterate them; `group += expr` appends to each; join() gathers variables."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `for f in forks: f += ...` rebinds the loop variable only; `forks[i] += ...` lands here with the same state.
        if value is not self.states[i]:
            raise TypeError("fork states cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Expr | str | list | tuple | Callable[[int], Any]) -> "ProgramStateGroup":
        """An expr goes to every state; a list/tuple gives one per state; a callable is called with each state's index."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} forks")
            for s, e in zip(self.states, other):
                s += e
        elif callable(other) and not isinstance(other, Expr):
            for i, s in enumerate(self.states):
                s += other(i)
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork. gather_variable: each variable a fork created is set in the parent as the list of the
        forks' values. concate_and_append: instead append to the parent what each fork appended, in fork order (as
        in SGLang, the forks' variables stay in the forks)."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for s in self.states:
            s.sync()
        if mode == "concate_and_append":
            self.parent.executor.submit(Text("".join(s.executor.text_[s.executor.fork_start :] for s in self.states)))
            self.parent.sync()
            return
        self.parent.executor.wait_idle()
        parent_vars = set(self.parent.executor.variables)
        gathered: dict[str, list[Any]] = {}
        for s in self.states:
            for name, value in s.executor.variables.items():
                if name not in parent_vars:
                    gathered.setdefault(name, []).append(value)
        for name, values in gathered.items():
            self.parent[name] = values
