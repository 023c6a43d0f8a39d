"""Program: a decorated function `f(s, ...)`, run on a backend once (run) or over many inputs at once (run_batch)."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixserve.sampling_params import SamplingParams

from frontend_dsl.backends.base import Backend
from frontend_dsl.default_backend import resolve_backend
from frontend_dsl.errors import NotSupportedError, ProgramError
from frontend_dsl.executor import Executor
from frontend_dsl.prefix_gate import GateTicket, PrefixGate
from frontend_dsl.state import ProgramState

MAX_AUTO_THREADS = 64
_EAGER = (
    "frontend_dsl runs programs eagerly and does not trace them; run_batch computes its inputs' common prefix "
    "once instead, and forks their shared text"
)


def sampling_defaults(
    max_new_tokens: int,
    stop: str | Sequence[str],
    stop_token_ids: Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    frequency_penalty: float,
    presence_penalty: float,
    ignore_eos: bool,
    return_logprob: bool | None,
    logprob_start_len: int | None,
    top_logprobs_num: int | None,
    return_text_in_logprobs: bool | None,
) -> dict[str, Any]:
    """run()'s sampling args as engine sampling params (validated now, so a bad value fails before anything runs)."""
    params = dict(
        max_new_tokens=max_new_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(stop_token_ids),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
    )
    SamplingParams.from_dict(params)
    return params | dict(
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )


def _in_order(futures: list[Future], inputs: list[dict[str, Any]], pbar: Any) -> Iterator[ProgramState]:
    """Each program's state in input order as it is done; a failed program's error (noting its input) is raised."""
    try:
        for i, f in enumerate(futures):
            err = f.exception()
            if err is not None:
                err.add_note(f"(input #{i} of {len(inputs)} in run_batch: {inputs[i]!r})")
                raise err
            yield f.result()
    finally:
        if pbar is not None:
            for f in futures:
                f.exception()  # the bar closes once every program is done, as it does without generator_style
            pbar.close()


class Program:
    """A DSL program; the wrapped function takes the state first, then the program's arguments."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"a program's first parameter must be the state `s`; {func.__name__} has none")
        self.func = func
        self.name: str = func.__name__
        self.arg_names = [p.name for p in params[1:]]
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> "Program":
        """A copy of this program with some arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.name} has no argument(s) {', '.join(sorted(unknown))}")
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Backend | None = None,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> ProgramState:
        """Run once. The sampling args apply to every gen that does not set its own. Raises ProgramError if the
        program fails; with stream=True it returns at once and `state.text_iter()` yields text as it comes
        (raising the ProgramError at its end). use_thread is accepted for SGLang compatibility: gens always run on
        the state's worker thread, which is what lets forks run concurrently."""
        defaults = sampling_defaults(
            max_new_tokens,
            stop,
            stop_token_ids,
            temperature,
            top_p,
            top_k,
            min_p,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
        )
        return self._run(resolve_backend(backend), args, {**kwargs, **self.bind_arguments}, defaults, stream, None)

    __call__ = run

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per input, concurrently, with the inputs' common prompt prefix computed once (see prefix_gate).
        Returns the states in input order; if any program failed, raises the first one's ProgramError.
        generator_style: return at once an iterator that yields each state (in input order) when it is done."""
        defaults = sampling_defaults(
            max_new_tokens,
            stop,
            stop_token_ids,
            temperature,
            top_p,
            top_k,
            min_p,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
        )
        backend = resolve_backend(backend)
        inputs = [self._as_kwargs(x) for x in batch_kwargs]
        if not inputs:
            return []
        if num_threads == "auto":
            num_threads = MAX_AUTO_THREADS
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
        num_threads = min(num_threads, len(inputs))
        gate = PrefixGate(backend.prefill, expected=num_threads)

        def run_one(kwargs: dict[str, Any]) -> ProgramState:
            ticket = gate.ticket()
            try:
                return self._run(backend, (), kwargs, defaults, False, ticket)
            finally:
                ticket.leave()

        pbar = None
        if progress_bar:
            import tqdm

            pbar = tqdm.tqdm(total=len(inputs))
        pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"run_batch-{self.name}")
        futures = [pool.submit(run_one, kw) for kw in inputs]
        pool.shutdown(wait=False)  # the submitted work still runs; the pool's threads exit when it is done
        if pbar is not None:
            for f in futures:
                f.add_done_callback(lambda _: pbar.update())
        results = _in_order(futures, inputs, pbar)
        if generator_style:
            return results
        for f in futures:
            f.exception()  # wait for every program, so none is still running when the first error is raised
        return list(results)

    def _as_kwargs(self, x: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(x, dict):
            return {**x, **self.bind_arguments}
        if isinstance(x, (list, tuple)):
            if len(x) > len(self.arg_names):
                raise TypeError(f"{self.name} takes {len(self.arg_names)} arguments, got {len(x)}: {x!r}")
            return {**dict(zip(self.arg_names, x)), **self.bind_arguments}
        raise TypeError(f"run_batch inputs must be dicts of arguments (or lists of them), got {type(x).__name__}")

    def _run(
        self,
        backend: Backend,
        args: tuple,
        kwargs: dict[str, Any],
        defaults: dict[str, Any],
        stream: bool,
        ticket: GateTicket | None,
    ) -> ProgramState:
        state = ProgramState(Executor(backend, defaults, stream, ticket, fed_async=stream))
        if stream:
            threading.Thread(
                target=self._execute, args=(state, args, kwargs), name=f"program-{self.name}", daemon=True
            ).start()
            return state
        self._execute(state, args, kwargs)
        if state.executor.error is not None:
            raise state.executor.error
        return state

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        """Call the function, wait for its queued work, and turn any failure into the state's ProgramError."""
        ex = state.executor
        try:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            except Exception as e:
                ex.fail(e)
            ex.wait_idle()
            if ex.error is not None and not isinstance(ex.error, ProgramError):
                err = ProgramError(self.name, ex.error, ex.text_)
                err.__cause__ = ex.error
                ex.fail(err, replace=True)
        finally:
            ex.end()

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(f"{self.name}.trace() is not supported: {_EAGER}")

    def cache(self, *args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(f"{self.name}.cache() is not supported: {_EAGER}")

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(f"{self.name}.compile() is not supported: {_EAGER}")

    def __repr__(self) -> str:
        return f"Program({self.name})"
