"""Who is admitted first: request priority, then a fair share of prefill tokens between tenants, then the queue
policy (longest cached prefix first, or arrival order) within a tenant.

Fair share is deficit round robin in its fluid form: each tenant with waiting work has a count of prefill tokens it
was served; the next admission goes to the tenant served least, its head request first. A tenant that was idle
starts from the least count among the busy ones, so it cannot bank credit while away, and a flood of one tenant
(however well its prompts hit the cache) cannot push another's requests back: they interleave by tokens served.

Priority sits above both: a waiting request of higher priority is admitted first, and when slots or pages are short
it may retract a running request of lower priority; with fair share on, a tenant holding far fewer running requests
than another may retract one of the other's (`preemptible`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from radixserve.request import Req


class FairShare:
    """Prefill tokens served per tenant, and the admission order they imply."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0) + tokens

    def order(
        self, candidates: list[Req], within: Callable[[list[Req]], list[Req]], running: Iterable[Req] = ()
    ) -> list[Req]:
        """Candidates by priority (higher first), each priority level interleaved across tenants by tokens served
        (among equals, the tenant with fewer running requests, then the one whose head came first); `within`
        orders one tenant's requests (the queue policy)."""
        active = {r.tenant for r in candidates}
        self._forget_idle(active)
        held: dict[str, int] = defaultdict(int)
        for r in running:
            held[r.tenant] += 1
        out: list[Req] = []
        for level in _by_priority(candidates):
            queues = {t: deque(within(reqs)) for t, reqs in _by_tenant(level).items()}
            served = dict(self.served)
            while queues:
                tenant = min(queues, key=lambda t: (served[t], held[t], queues[t][0].created))
                req = queues[tenant].popleft()
                out.append(req)
                served[tenant] += max(req.num_fill - req.kv_len, 1)  # what admitting it would charge, at most
                if not queues[tenant]:
                    del queues[tenant]
        return out

    def _forget_idle(self, active: set[str]) -> None:
        """Tenants with nothing waiting drop out; one that (re)appears starts at the least count of the others."""
        for t in [t for t in self.served if t not in active]:
            del self.served[t]
        floor = min(self.served.values(), default=0)
        for t in active:
            self.served.setdefault(t, floor)
        # Keep the counts small: only their differences matter.
        if floor > 1 << 40:
            self.served = {t: v - floor for t, v in self.served.items()}


def by_priority_only(candidates: list[Req], within: Callable[[list[Req]], list[Req]]) -> list[Req]:
    """Fair share off: priority levels, each in the queue policy's order across all tenants."""
    return [r for level in _by_priority(candidates) for r in within(level)]


def _by_priority(reqs: Iterable[Req]) -> list[list[Req]]:
    levels: dict[int, list[Req]] = defaultdict(list)
    for r in reqs:
        levels[r.priority].append(r)
    return [levels[p] for p in sorted(levels, reverse=True)]


def _by_tenant(reqs: Iterable[Req]) -> dict[str, list[Req]]:
    groups: dict[str, list[Req]] = defaultdict(list)
    for r in reqs:
        groups[r.tenant].append(r)
    return groups


def victim_key(req: Req) -> tuple[int, int, float]:
    """Retraction order: lowest priority first, then the least advanced, then the newest."""
    return (req.priority, len(req.output_ids), -req.created)


def preemptible(running: Iterable[Req], than: Req, fair: bool) -> list[Req]:
    """Running requests `than` may retract to make room for itself (none with a step in flight): those of lower
    priority; failing those, with fair share on, those of equal or lower priority of the tenant holding the most
    running requests, when it holds at least two more than `than`'s tenant (so that two tenants never trade the
    same slot back and forth). Without the second rule a tenant arriving while another's flood holds every slot
    would wait for one of the flood's requests to end."""
    free = [r for r in running if not r.steps_in_flight]
    lower = [r for r in free if r.priority < than.priority]
    if lower or not fair:
        return lower
    held: dict[str, int] = defaultdict(int)
    for r in running:
        held[r.tenant] += 1
    top = max(held, key=lambda t: held[t], default=None)
    if top is None or held[top] < held[than.tenant] + 2:
        return []
    return [r for r in free if r.tenant == top and r.priority <= than.priority]
