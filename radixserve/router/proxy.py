"""Forward one generation request to the worker the policy picks, retrying elsewhere while nothing reached the client.

A non-streaming answer is read whole before the client sees a byte, so a worker that dies at any point of it is
retried on another. A streamed answer is retried only if the worker fails before its status line; once events flow,
a worker's death ends the stream with an in-band error event and [DONE] (the client's status line is already sent).
Events are passed on whole (split at blank lines), so a client never receives half an event before that error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.router.keys import routing_key
from radixserve.router.state import Router
from radixserve.router.workers import Worker

RETRY_STATUS = {429, 502, 503, 504}  # queue full, or the worker is draining/dead: another worker may answer
REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
RESPONSE_HEADERS = ("content-type", "retry-after", "cache-control", "x-accel-buffering", "x-request-id")
WORKER_HEADER = "x-radixserve-worker"  # which worker answered: for clients debugging affinity, and for tests


def error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    """The OpenAI error body, as the workers answer it."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}}, status_code=status)


def _headers(upstream: httpx.Response, worker: Worker) -> dict[str, str]:
    h = {k: upstream.headers[k] for k in RESPONSE_HEADERS if k in upstream.headers}
    h[WORKER_HEADER] = worker.url
    return h


async def forward_generation(router: Router, request: Request) -> Response:
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError:
        return error(400, "the request body is not valid JSON", "invalid_request_error")
    if not isinstance(data, dict):
        return error(400, "the request body must be a JSON object", "invalid_request_error")
    path = request.url.path
    key, start = routing_key(path, data, request.headers.get("authorization"))
    headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
    tried: set[str] = set()
    last = "no healthy worker"
    for attempt in range(router.config.max_attempts):
        workers = router.pool.healthy(exclude=tried)
        if not workers:
            break
        worker, why = router.policy.choose(key, workers, start)
        tried.add(worker.url)
        router.decisions[worker.url, why] += 1
        if attempt:
            router.retries += 1
        worker.requests += 1
        worker.load += 1
        streaming = False
        try:
            req = router.client.build_request("POST", worker.url + path, content=body, headers=headers)
            upstream = await router.client.send(req, stream=True)
            try:
                if upstream.status_code in RETRY_STATUS:
                    last = f"worker {worker.url} answered {upstream.status_code}"
                    if upstream.status_code != 429:  # a full queue is load, not ill health
                        router.request_failed(worker, last)
                    continue
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    streaming = True  # the stream's generator now owns the response and the load count
                    return RelayResponse(Relay(router, worker, upstream), _headers(upstream, worker))
                content = await upstream.aread()
                return Response(content, upstream.status_code, headers=_headers(upstream, worker))
            finally:
                if not streaming:
                    await upstream.aclose()
        except httpx.TransportError as exc:
            last = f"worker {worker.url} failed: {type(exc).__name__}: {exc}"
            router.request_failed(worker, last)
        finally:
            if not streaming:
                worker.load -= 1
    return error(503, f"no worker could serve the request ({last})", "service_unavailable", "no_worker")


class Relay:
    """One upstream stream; release() closes it and gives back the worker's load exactly once, whether the events ran
    to the end, broke off, or never started (a client gone before the first byte)."""

    def __init__(self, router: Router, worker: Worker, upstream: httpx.Response) -> None:
        self.router, self.worker, self.upstream = router, worker, upstream
        self.released = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.load -= 1
            await self.upstream.aclose()

    async def events(self) -> AsyncIterator[bytes]:
        """The worker's events as they come, whole; on its failure an error event and [DONE]."""
        pending = b""
        try:
            async for chunk in self.upstream.aiter_raw():
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[: end + 2]
                    pending = pending[end + 2 :]
            if pending:
                yield pending
        except httpx.TransportError as exc:
            self.router.request_failed(self.worker, f"stream broke: {type(exc).__name__}")
            err = {
                "error": {
                    "message": f"worker {self.worker.url} failed mid-stream; the answer is incomplete",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "worker_failed",
                }
            }
            yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await self.release()


class RelayResponse(StreamingResponse):
    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), relay.upstream.status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.release()
