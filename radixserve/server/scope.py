"""Who may see which cache namespaces on the explorer: the one rule, in one function (`view_scope`).

A request's cache namespace is its API key's tenant, optionally followed by `|cache_salt` (serving.cache_salt). An
admin sees every namespace; any other key only its own tenant's: no token text of one tenant reaches another. Without
roles, a server without API keys treats every caller as the admin and every key as a tenant.
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
    """The namespaces this caller may look at. With roles (a Principal in the scope, issue 21) an admin sees all and
    a user its own; before roles, a key sees its own tenant and a server without keys is the admin's."""
    state = request.scope.get("state", {})
    principal = state.get("principal")
    if principal is not None:
        return NamespaceScope(None if principal.is_admin else principal.namespace)
    return NamespaceScope(state.get("tenant") or None)
