"""API keys: every endpoint but /health needs `Authorization: Bearer <key>`; each key is its own cache namespace."""
from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.errors import ApiError, error_response

OPEN_PATHS = frozenset({"/health", "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)  # the explorer's page and assets hold no data; it sends the key itself


def tenant_of(key: str) -> str:
    """The cache namespace of an API key: a digest, so the key itself never travels into the cache."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:32]


class ApiKeyAuth:
    """ASGI middleware: 401 without a valid bearer key; with one, scope["state"]["tenant"] names the key's namespace."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("api keys must be non-empty strings")
        self.app = app
        self.keys = [(k.encode(), tenant_of(k)) for k in keys]

    def _tenant(self, scope: Scope) -> str | None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, tenant in self.keys:  # compare against every key: the time taken says nothing about which matched
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None:
            err = ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error_response(err)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
