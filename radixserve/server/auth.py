"""API keys: every endpoint but /health needs `Authorization: Bearer <key>` (or `x-api-key: <key>`); each key is its own cache namespace.

The middleware puts the request's Principal (radixserve/server/tenants.py: name, role, namespace, limits) in
scope["state"]["principal"]; handlers read it with `principal_of(request)`. Without keys every request is OPEN
(the operator, one shared namespace)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.errors import ApiError, error_response
from radixserve.server.tenants import NOBODY, OPEN, KeyRing, Principal, tenant_of

__all__ = ["ApiKeyAuth", "OPEN_PATHS", "principal_of", "tenant_of", "forbidden"]

OPEN_PATHS = frozenset({"/health", "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)  # the explorer's page and assets hold no data; it sends the key itself


def principal_of(request: Request | Scope) -> Principal:
    scope = request.scope if isinstance(request, Request) else request
    return scope.get("state", {}).get("principal", OPEN)


def forbidden(what: str) -> ApiError:
    return ApiError(403, f"{what} needs an admin key", type="permission_error", code="admin_only")


class ApiKeyAuth:
    """ASGI middleware: 401 without a valid bearer key; with one, the key's Principal goes into the scope."""

    def __init__(self, app: ASGIApp, keys: KeyRing | None) -> None:
        self.app = app
        self.keys = keys

    def _principal(self, scope: Scope) -> Principal | None:
        assert self.keys is not None
        headers = dict(scope["headers"])
        if b"authorization" not in headers and b"x-api-key" in headers:  # how the anthropic SDK sends its key
            return self.keys.lookup(headers[b"x-api-key"].strip())
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self.keys.lookup(token.strip())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if self.keys is None or scope["path"] in OPEN_PATHS:
            state["principal"] = OPEN if self.keys is None else NOBODY
            await self.app(scope, receive, send)
            return
        principal = self._principal(scope)
        if principal is None:
            err = ApiError(
                401,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error_response(err, scope["path"])(scope, receive, send)
            return
        state["principal"] = principal
        state["tenant"] = principal.namespace
        await self.app(scope, receive, send)
