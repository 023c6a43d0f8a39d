"""Who may see which cache namespaces on the explorer: the one rule, in one function (`view_scope`).

A request's cache namespace is its API key's tenant, optionally followed by `|cache_salt` (serving.cache_salt). Until
roles exist, a server without API keys treats every caller as the admin (all namespaces), and with keys each key
sees only its own tenant's namespaces: no token text of one tenant reaches another.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request


@dataclass(frozen=True)
class NamespaceScope:
    tenant: str | None  # None: the admin, who sees every namespace

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def allows(self, namespace: str) -> bool:
        t = self.tenant
        return t is None or namespace == t or namespace.startswith(t + "|")


def view_scope(request: Request) -> NamespaceScope:
    """The namespaces this caller may look at (switch to roles here: an admin role -> NamespaceScope(None))."""
    tenant = request.scope.get("state", {}).get("tenant")
    return NamespaceScope(tenant or None)
