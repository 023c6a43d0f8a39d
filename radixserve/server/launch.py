"""`radixserve serve`: build the Engine and the app, run uvicorn, drain gracefully on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from radixserve import __version__
from radixserve.log_bounds import bound
from radixserve.server.app import DEFAULT_MAX_BODY_BYTES, build_app
from radixserve.server.tenants import KeyRing, KeySources
from radixserve.summary import startup_summary
from radixserve.server.timeouts import header_timeout_protocol

log = logging.getLogger("radixserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM means: stop admitting, let running requests finish within the grace period
    (uvicorn's timeout_graceful_shutdown, after which their tasks are cancelled and the engine aborts them), exit 0.
    uvicorn would re-raise the signal after shutting down, which kills the process with -SIGTERM instead."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None], ready_line: str = "") -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.ready_line = ready_line

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_line:
            print(self.ready_line, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_drain()
        if sig == signal.SIGTERM:
            if self.should_exit:  # a second SIGTERM: stop waiting for running requests
                self.force_exit = True
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def run_server(
    engine_kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | list[str] | KeySources | None = None,
    max_queued_requests: int | None = None,
    served_model_name: str | None = None,
    grace_period_s: float = 30.0,
    max_connections: int = 1024,
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    otlp_endpoint: str | None = None,
    incremental_streaming_output: bool = False,
    reasoning_parser: str = "auto",
    agent_retention: bool = True,
) -> None:
    """Serve Engine(**engine_kwargs) over HTTP until SIGTERM/SIGINT; returns after a graceful drain. If the engine
    stops (a fault that repeats every step), the server drains and the process exits 1 for a supervisor to restart."""
    from radixserve import Engine

    keys = _key_ring(api_key)  # before the model loads: a bad key file fails fast
    kwargs = dict(engine_kwargs)
    if max_queued_requests is not None:
        kwargs["max_queued_requests"] = max_queued_requests  # the engine enforces it without a round trip
    engine = Engine(**kwargs)
    try:
        app = build_app(
            engine,
            api_key=keys,
            max_queued_requests=max_queued_requests,
            served_model_name=served_model_name,
            max_body_bytes=max_body_bytes,
            body_timeout_s=body_timeout_s,
            otlp_endpoint=otlp_endpoint,
            incremental_streaming_output=incremental_streaming_output,
            reasoning_parser=reasoning_parser,
            agent_retention=agent_retention,
        )
        state = app.state.server

        def drain() -> None:
            if not state.draining:
                log.info("draining: no new requests; running ones get %.0f s to finish", grace_period_s)
            state.draining = True

        # limit_concurrency: connections and tasks past it get a 503 at once instead of piling up.
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            lifespan="off",
            timeout_graceful_shutdown=grace_period_s,
            timeout_keep_alive=5,
            limit_concurrency=max_connections,
            http=header_timeout_protocol(header_timeout_s),
        )
        for name in ("uvicorn.access", "uvicorn.error"):  # after Config, which sets uvicorn's logging up
            bound(logging.getLogger(name))  # a request line holds the client's path and query: cut when long
        url = f"http://{host}:{port}"
        print(
            f"radixserve {__version__}\n{startup_summary(engine, url, api_key=keys.describe() if keys else None)}",
            flush=True,
        )
        if keys is not None and keys.file is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, lambda sig, frame: keys.reload_in_background())  # uvicorn leaves SIGHUP alone
        server = DrainingServer(config, drain, ready_line=f"ready: serving on {url}")
        watchdog = threading.Thread(target=_exit_when_engine_dies, args=(engine, server, drain), daemon=True)
        watchdog.start()
        server.run()
        if engine.error is not None:
            raise SystemExit(f"engine stopped: {engine.error!r}")  # exit status 1
    finally:
        engine.shutdown()


def _key_ring(api_key: str | list[str] | KeySources | None) -> KeyRing | None:
    if api_key is None:
        return None
    if isinstance(api_key, KeySources):
        return KeyRing(api_key)
    return KeyRing.from_keys(api_key)


def _exit_when_engine_dies(engine: Any, server: uvicorn.Server, drain: Callable[[], None]) -> None:
    while not server.should_exit:
        if engine.error is not None:
            log.error("engine stopped (%r): draining and exiting with status 1", engine.error)
            drain()
            server.should_exit = True
            return
        time.sleep(1.0)
