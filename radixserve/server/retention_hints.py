"""Retention from the request APIs (radixserve/cache/retention.py): what a request asks for as its engine call's
retention (the agent retention of a turn that ended in tool calls is agent_retention.py's).

- `retention_seconds` + `retention_priority` (our extra on chat, completions and the native API) are taken as they are.
- OpenAI's `prompt_cache_retention`: "in_memory" is OpenAI's 5-10 minutes of inactivity (10 minutes here), "24h"
  is 24 hours; both at the default priority, within the retention budget like any.
- Anthropic's `cache_control`, on /v1/messages (messages_convert.py) and on Chat Completions content parts (where
  OpenRouter and LiteLLM pass it): the longest ttl of the request's markers ("5m" or "1h"); the whole prefix the
  request leaves in the cache is retained, not only the part up to the marked block.
A request naming more than one takes the first of these that it sets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from radixserve.server.errors import bad_request
from radixserve.server.protocol import CacheControl, ChatCompletionRequest, SamplingFields

PROMPT_CACHE_RETENTION = {"in_memory": 600.0, "in-memory": 600.0, "24h": 24 * 3600.0}
CACHE_CONTROL_TTL = {"5m": 300.0, "1h": 3600.0}


def longest_ttl(controls: Iterable[CacheControl]) -> str | None:
    """The longest ttl of these cache_control markers ("5m" unless one says "1h"), None for no marker; a 400 naming
    cache_control for a marker we cannot honour."""
    ttls = set()
    for c in controls:
        if c.type != "ephemeral" or c.ttl not in (None, "5m", "1h"):
            raise bad_request(
                f"cache_control must be ephemeral with ttl 5m or 1h, got {c.type!r} {c.ttl!r}", "cache_control"
            )
        ttls.add(c.ttl or "5m")
    return max(ttls, key=CACHE_CONTROL_TTL.__getitem__) if ttls else None


def hinted(req: SamplingFields) -> dict[str, Any]:
    """The engine call's retention arguments: the request's `retention_seconds`, else its `prompt_cache_retention`,
    else its content parts' `cache_control`; none for none of them (the engine validates the values and names the
    field)."""
    seconds = req.retention_seconds
    if seconds is None and req.prompt_cache_retention is not None:
        seconds = PROMPT_CACHE_RETENTION.get(req.prompt_cache_retention)
        if seconds is None:
            raise bad_request(
                f"prompt_cache_retention must be in_memory or 24h, got {req.prompt_cache_retention!r}",
                param="prompt_cache_retention",
            )
    ttl = longest_ttl(_part_controls(req)) if isinstance(req, ChatCompletionRequest) else None  # always checked
    if seconds is None and ttl is not None:
        seconds = CACHE_CONTROL_TTL[ttl]
    if seconds is None:
        return {}
    return {"retention_seconds": seconds, "retention_priority": req.retention_priority}


def _part_controls(req: ChatCompletionRequest) -> list[CacheControl]:
    parts = [p for m in req.messages if isinstance(m.content, list) for p in m.content]
    return [p.cache_control for p in parts if p.cache_control is not None]
