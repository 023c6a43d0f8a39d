"""A small JSON-over-HTTP client for the HTTP backends: every request has a timeout, and every failure (unreachable,
timeout, HTTP error status, a broken event stream) raises BackendError naming the request."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from frontend_dsl.errors import BackendError


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return str(obj["error"].get("message", obj["error"]))
    return str(obj)[:500]


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        """timeout_s bounds every request (for an event stream: the wait for each next event)."""
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base_url + path
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raise BackendError(
                f"{method} {url} failed with HTTP {e.code}: {_error_message(e.read())}", status=e.code
            ) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise BackendError(f"{method} {url}: no answer within {self.timeout_s} s") from None
            raise BackendError(f"cannot reach the server at {self.base_url}: {e.reason}") from None
        except (TimeoutError, socket.timeout):
            raise BackendError(f"{method} {url}: no answer within {self.timeout_s} s") from None
        except OSError as e:
            raise BackendError(f"{method} {url} failed: {e}") from None

    def read(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        with self.open(method, path, body) as resp:
            try:
                return resp.read()
            except (TimeoutError, socket.timeout):
                raise BackendError(
                    f"{method} {self.base_url + path}: answer not complete within {self.timeout_s} s"
                ) from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        raw = self.read(method, path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise BackendError(f"{method} {self.base_url + path} answered non-JSON: {raw[:200]!r}") from None

    def events(self, method: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON payloads of a server-sent event stream until [DONE]; leaving early closes the connection (the
        server then aborts the request)."""
        url = self.base_url + path
        with self.open(method, path, body) as resp:
            while True:
                try:
                    line = resp.readline()
                except (TimeoutError, socket.timeout):
                    raise BackendError(f"{method} {url}: no stream chunk within {self.timeout_s} s") from None
                if not line:
                    raise BackendError(f"{method} {url}: the stream ended before the request finished")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:") :].strip()
                if payload == b"[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise BackendError(f"{method} {url} failed mid-stream: {_error_message(payload)}")
                yield chunk
