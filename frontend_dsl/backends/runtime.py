"""Runtime: an in-process radixserve Engine as a DSL backend (SGLang's Runtime starts a server; this one is a library)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from radixserve.server.generate_api import with_token_text

from frontend_dsl.backends.base import Backend
from frontend_dsl.backends.server_args import engine_args_from_server_args
from frontend_dsl.errors import BackendError


async def _next(chunks: Any) -> tuple[bool, Any]:
    try:
        return True, await chunks.__anext__()
    except StopAsyncIteration:
        return False, None


class Runtime(Backend):
    def __init__(self, model_path: str | None = None, *, engine: Any = None, **server_args: Any) -> None:
        """Start an Engine on model_path (None: the default model), or wrap an existing `engine=` (then shutdown()
        leaves it running: its owner stops it). server_args are SGLang's server arguments or the Engine's own
        (see server_args.py: mapped where the Engine has them, warned about and ignored where harmless, refused
        where they would change results)."""
        super().__init__()
        if engine is not None:
            if model_path is not None or server_args:
                raise ValueError("pass either engine= or model_path/server args, not both")
            self.engine = engine
            self._owns_engine = False
        else:
            from radixserve import Engine

            self.engine = Engine(model=model_path, **engine_args_from_server_args(server_args))
            self._owns_engine = True

    def shutdown(self) -> None:
        """Stop the engine this Runtime started."""
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def generate(
        self,
        *,
        text: str | None = None,
        input_ids: list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            out = self.engine.generate(
                prompt=text,
                input_ids=input_ids,
                sampling_params=sampling_params,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
            )
        except (ValueError, RuntimeError) as e:
            raise BackendError(f"engine refused the request: {type(e).__name__}: {e}") from e
        if not return_text_in_logprobs:
            return out
        if isinstance(out, list):
            return [with_token_text(self.engine.tokenizer, o) for o in out]
        return with_token_text(self.engine.tokenizer, out)

    def generate_stream(
        self,
        text: str,
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> Iterator[dict[str, Any]]:
        # The engine streams through an async generator; drive it from this (worker) thread on a private event loop,
        # handing each chunk on as soon as it arrives. Closing early aborts the request in the engine.
        loop = asyncio.new_event_loop()
        try:
            try:
                chunks = self.engine.async_generate(
                    prompt=text,
                    sampling_params=sampling_params,
                    stream=True,
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num,
                )
            except (ValueError, RuntimeError) as e:
                raise BackendError(f"engine refused the request: {type(e).__name__}: {e}") from e
            try:
                while True:
                    try:
                        more, chunk = loop.run_until_complete(_next(chunks))
                    except (ValueError, RuntimeError) as e:
                        raise BackendError(f"engine failed the request: {type(e).__name__}: {e}") from e
                    if not more:
                        return
                    yield with_token_text(self.engine.tokenizer, chunk) if return_text_in_logprobs else chunk
            finally:
                loop.run_until_complete(chunks.aclose())
        finally:
            loop.close()

    def tokenize(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)

    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def metrics(self) -> dict[str, Any]:
        """The engine's counters (prefill tokens computed, cached tokens, ...)."""
        return self.engine.metrics()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def pin(self, text: str) -> dict[str, Any]:
        try:
            return self.engine.pin(prompt=text)
        except ValueError as e:
            raise BackendError(f"engine refused the pin: {e}") from e

    def unpin(self, text: str) -> bool:
        return self.engine.unpin(prompt=text)

    def __repr__(self) -> str:
        return f"Runtime({self.engine.model_info().get('model_path')!r})"
