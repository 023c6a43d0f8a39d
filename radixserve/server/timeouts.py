"""Connection limits against slow clients: headers must arrive within a time limit (uvicorn has none), and a body
must keep arriving (each chunk within a time limit), so that idle or trickling connections cannot pile up."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.server.errors import ApiError, error_response


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose first request's headers are not complete in `seconds`
    (later requests on the connection are covered by uvicorn's keep-alive timeout)."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._headers_timer: asyncio.TimerHandle | None = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class BodyTimeout(Exception):
    """A request body stalled (see BodyTimeoutMiddleware): answered 408 by `body_timeout_handler`."""


class BodyTimeoutMiddleware:
    """Each `http.request` message of a body must come within `seconds` of the last, or BodyTimeout is raised in
    the handler that reads it."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # after the body only a disconnect can come: no time limit on waiting for it
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.seconds)
            except asyncio.TimeoutError:
                raise BodyTimeout(f"request body not received within {self.seconds:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


async def body_timeout_handler(request: Any, exc: Exception) -> Any:
    return error_response(ApiError(408, str(exc), code="body_timeout"), request.url.path)
