"""Retention from the request APIs (radixserve/cache/retention.py): what a request asks for as its engine call's
retention (the agent retention of a turn that ended in tool calls is agent_retention.py's).

- `retention_seconds` + `retention_priority` (our extra on chat, completions and the native API) are taken as they are.
- OpenAI's `prompt_cache_retention`: "in_memory" is OpenAI's 5-10 minutes of inactivity (10 minutes here), "24h"
  is 24 hours; both at the default priority, within the retention budget like any.
- Anthropic's `cache_control` (messages_convert.py): the longest ttl of the request's markers ("5m" or "1h"); the
  whole prefix the request leaves in the cache is retained, not only the part up to the marked block.
"""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import bad_request
from radixserve.server.protocol import SamplingFields

PROMPT_CACHE_RETENTION = {"in_memory": 600.0, "in-memory": 600.0, "24h": 24 * 3600.0}
CACHE_CONTROL_TTL = {"5m": 300.0, "1h": 3600.0}


def hinted(req: SamplingFields) -> dict[str, Any]:
    """The engine call's retention arguments: the request's `retention_seconds`, else its `prompt_cache_retention`;
    none for neither (the engine validates the values and names the field)."""
    seconds = req.retention_seconds
    if seconds is None and req.prompt_cache_retention is not None:
        seconds = PROMPT_CACHE_RETENTION.get(req.prompt_cache_retention)
        if seconds is None:
            raise bad_request(
                f"prompt_cache_retention must be in_memory or 24h, got {req.prompt_cache_retention!r}",
                param="prompt_cache_retention",
            )
    if seconds is None:
        return {}
    return {"retention_seconds": seconds, "retention_priority": req.retention_priority}
