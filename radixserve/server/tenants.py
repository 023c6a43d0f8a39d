"""API keys, who holds them and what they may do: the one place that knows about roles.

A key entry is the key, then optional `name=`, `role=admin|user` and limits (`max_concurrent=`, `max_queued=`,
`tokens_per_minute=`), separated by spaces. Entries come from `--api-key` (repeatable, commas separate entries),
`--api-key-file` (one entry a line, a `#` at the start or after a blank starts a comment) and `RADIXSERVE_API_KEYS` (commas or newlines separate
entries). Keys from `--api-key` and the environment are the operator's: `admin` unless they say otherwise; keys from
the file are tenants': `user` unless they say otherwise.

Only a SHA-256 digest of each key is kept in memory; a request's key is hashed and compared against every digest in
constant time, so neither the keys nor the time taken say which one matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("radixserve.server")

ROLES = ("admin", "user")
LIMITS = ("max_concurrent", "max_queued", "tokens_per_minute")
ENV_VAR = "RADIXSERVE_API_KEYS"
_COMMENT = re.compile(r"(^|\s)#.*$")  # a '#' starting a line or after a blank: a key itself may hold '#'


@dataclass(frozen=True)
class Limits:
    """Per-key quotas; None: no limit."""

    max_concurrent: int | None = None  # requests of this key generating at once; more wait (see max_queued)
    max_queued: int | None = None  # requests of this key waiting for a concurrent slot; more get 429
    tokens_per_minute: int | None = None  # prompt + completion tokens in any 60 s; past it 429


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the key's name (never the key), its role, its cache namespace and its limits."""

    name: str
    role: str
    namespace: str  # "" only for the open server (no keys): one shared namespace
    limits: Limits = field(default_factory=Limits)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def owns(self, namespace: str) -> bool:
        """Whether `namespace` (a cache namespace) is this key's: its own, or its own with a `|cache_salt` suffix."""
        return namespace == self.namespace or namespace.startswith(self.namespace + "|")

    def can_see(self, namespace: str) -> bool:
        """Whether this principal may read or flush `namespace`: admins every one, users their own."""
        return self.is_admin or self.owns(namespace)


# The server without keys: everyone is the operator, in one shared namespace (how it was before keys had roles).
OPEN = Principal(name="anonymous", role="admin", namespace="")
# A request to an open path (/health) of a server with keys: it may see nothing.
NOBODY = Principal(name="nobody", role="user", namespace="\x00nobody")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def tenant_of(key: str) -> str:
    """The cache namespace of an API key: a digest, so the key itself never travels into the cache."""
    return namespace_of(key_digest(key))


def namespace_of(digest: bytes) -> str:
    return "key-" + digest.hex()[:32]


@dataclass(frozen=True)
class KeyEntry:
    digest: bytes
    principal: Principal


class ApiKeyError(ValueError):
    """A bad key entry (empty key, unknown option, duplicate); raised at start-up and on reload."""


def parse_entry(text: str, default_role: str, where: str) -> KeyEntry:
    """One entry: `KEY [name=N] [role=admin|user] [max_concurrent=N] [max_queued=N] [tokens_per_minute=N]`."""
    parts = text.split()
    if not parts or "=" in parts[0] and parts[0].split("=", 1)[0] in ("name", "role", *LIMITS):
        raise ApiKeyError(f"{where}: empty API key")
    key, options = parts[0], parts[1:]
    digest = key_digest(key)
    name, role, limits = "key-" + digest.hex()[:8], default_role, {}
    for opt in options:
        k, sep, v = opt.partition("=")
        if not sep or not v:
            raise ApiKeyError(f"{where}: option {opt!r} is not name=value")
        if k == "name":
            name = v
        elif k == "role":
            if v not in ROLES:
                raise ApiKeyError(f"{where}: role must be admin or user, got {v!r}")
            role = v
        elif k in LIMITS:
            if not v.isdigit() or (k != "max_queued" and int(v) < 1):
                raise ApiKeyError(f"{where}: {k} must be an integer >= {0 if k == 'max_queued' else 1}, got {v!r}")
            limits[k] = int(v)
        else:
            raise ApiKeyError(f"{where}: unknown option {k!r} (name, role, {', '.join(LIMITS)})")
    return KeyEntry(digest, Principal(name, role, namespace_of(digest), Limits(**limits)))


def split_entries(value: str) -> list[str]:
    """Entries of a --api-key value or the environment variable: separated by commas or newlines (surrounding
    blanks are ignored; an empty entry between two separators is an empty key)."""
    return [e.strip() for e in value.strip().replace("\n", ",").split(",")]


def parse_file(text: str, where: str) -> list[KeyEntry]:
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", line).strip()
        if line:
            entries.append(parse_entry(line, "user", f"{where}:{n}"))
    return entries


@dataclass(frozen=True)
class KeySources:
    """Where the keys come from; `load()` reads them all again (SIGHUP reloads the file; the command line and the
    environment are as they were at start)."""

    cli: tuple[str, ...] = ()  # --api-key values, each possibly several comma-separated entries
    file: Path | None = None
    env: str | None = None  # the value of RADIXSERVE_API_KEYS at start

    @classmethod
    def from_environment(cls, cli: list[str] | None, file: str | Path | None) -> KeySources:
        return cls(tuple(cli or ()), Path(file) if file else None, os.environ.get(ENV_VAR))

    @property
    def configured(self) -> bool:
        return bool(self.cli or self.file is not None or self.env is not None)

    def load(self) -> list[KeyEntry]:
        return combine(self.fixed(), self.file)

    def fixed(self) -> list[KeyEntry]:
        """The entries of the command line and the environment (parsed once: only their digests are kept)."""
        entries = []
        for i, value in enumerate(self.cli):
            entries += [parse_entry(e, "admin", f"--api-key #{i + 1}") for e in split_entries(value)]
        if self.env is not None:
            entries += [parse_entry(e, "admin", ENV_VAR) for e in split_entries(self.env)]
        return entries


def combine(fixed: list[KeyEntry], file: Path | None) -> list[KeyEntry]:
    """The fixed entries plus the key file's, checked: at least one key, none twice, no name twice."""
    entries = list(fixed)
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise ApiKeyError(f"--api-key-file {file}: {exc.strerror}") from None
        entries += parse_file(text, str(file))
    if not entries:
        raise ApiKeyError("API keys were configured but none was given (an empty key would turn auth off)")
    _check_unique(entries)
    return entries


def _check_unique(entries: list[KeyEntry]) -> None:
    digests, names = set(), set()
    for e in entries:
        if e.digest in digests:
            raise ApiKeyError(f"the key named {e.principal.name!r} is given twice")
        if e.principal.name in names:
            raise ApiKeyError(
                f"two keys are named {e.principal.name!r}: names label quotas and metrics, keep them unique"
            )
        digests.add(e.digest)
        names.add(e.principal.name)


class KeyRing:
    """The keys in force (digests only: the sources' text is not kept); `lookup` is constant-time over all of them;
    `reload` reads the key file again and swaps the keys at once."""

    def __init__(self, sources: KeySources) -> None:
        self._fixed = sources.fixed()
        self.file = sources.file
        self._entries: tuple[KeyEntry, ...] = tuple(combine(self._fixed, self.file))
        self._lock = threading.Lock()

    @classmethod
    def from_keys(cls, keys: str | list[str]) -> KeyRing:
        """From `--api-key`-style values (a str may hold several comma-separated entries); admin by default."""
        return cls(KeySources(cli=(keys,) if isinstance(keys, str) else tuple(keys)))

    @property
    def principals(self) -> list[Principal]:
        return [e.principal for e in self._entries]

    def named(self, name: str) -> Principal | None:
        return next((p for p in self.principals if p.name == name), None)

    def describe(self) -> str:
        """For the start-up summary: how many keys, and their names by role (never the keys)."""
        by_role = {r: [p.name for p in self.principals if p.role == r] for r in ROLES}
        return f"required: {len(self._entries)} keys ({'; '.join(f'{r}: ' + ', '.join(n) for r, n in by_role.items() if n)})"

    def reload_in_background(self) -> None:
        """What SIGHUP does: reload on a thread, so the signal handler neither blocks the event loop on the file
        nor re-enters a reload it interrupted."""
        threading.Thread(target=self.reload, name="radixserve-key-reload", daemon=True).start()

    def lookup(self, token: bytes) -> Principal | None:
        digest = hashlib.sha256(token).digest()
        found = None
        for e in self._entries:  # compare against every key: the time taken says nothing about which matched
            if hmac.compare_digest(digest, e.digest):
                found = e.principal
        return found

    def reload(self) -> bool:
        """Read the sources again; on an error keep the keys in force and log why. Returns whether it swapped."""
        if self.file is None:
            return False
        with self._lock:
            try:
                entries = combine(self._fixed, self.file)
            except ApiKeyError as exc:
                log.error("API keys not reloaded, the old ones stay in force: %s", exc)
                return False
            self._entries = tuple(entries)
        log.info("API keys reloaded: %d keys (%s)", len(entries), ", ".join(e.principal.name for e in entries))
        return True
