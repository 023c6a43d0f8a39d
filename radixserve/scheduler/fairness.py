"""Who is admitted first: request priority, then a fair share of prefill tokens between tenants, then the queue
policy (longest cached prefix first, or arrival order) within a tenant.

Fair share is deficit round robin in its fluid form: each tenant with waiting work has a count of prefill tokens it
was served; the next admission goes to the tenant served least, its head request first. A tenant that was idle
starts from the least count among the busy ones, so it cannot bank credit while away, and a flood of one tenant
(however well its prompts hit the cache) cannot push another's requests back: they interleave by tokens served.

Priority sits above both: a waiting request of higher priority is admitted first, and when slots or pages are short
it may retract a running request of lower priority; with fair share on, a tenant holding far fewer running requests
than another may retract one of the other's (`preemptible`).

The order decides who goes first, not how long the others wait: a step cannot be interrupted, so a request that
arrives while one tenant's step runs waits for all of it, and on a compute-bound device a step's time grows with
its prefill tokens. So while another tenant has been active within the last `RECENT_STEPS` steps, no tenant may
take more than `1 / SHARE_DIVISOR` of a step's prefill budget (`room`): the step that a newly arrived request of
another tenant finds in flight, and the flood's part of the step it joins, hold at most that much of the flood's
prefill. A tenant alone keeps the whole budget.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from radixserve.request import Req


# A tenant with a request waiting or running within this many steps counts as active: long enough to span the gaps
# between the requests of a tenant sending a steady trickle, short enough that a tenant left alone soon gets whole
# steps again.
RECENT_STEPS = 256
# While another tenant is active, a tenant's prefill tokens in one step are at most this fraction of the budget.
SHARE_DIVISOR = 2


class FairShare:
    """Prefill tokens served per tenant, the admission order they imply, and each tenant's room in this step."""

    def __init__(self, step_budget: int) -> None:
        self.served: dict[str, int] = {}
        self.step_budget = step_budget
        self.steps = 0
        self.last_seen: dict[str, int] = {}  # tenant -> the last step it had a request waiting or running
        self.in_step: dict[str, int] = {}  # tenant -> prefill tokens it has in the step being scheduled

    def begin_step(self, tenants: Iterable[str]) -> None:
        """A new step is being scheduled; `tenants` have requests waiting or running."""
        self.steps += 1
        for t in tenants:
            self.last_seen[t] = self.steps
        for t in [t for t, s in self.last_seen.items() if self.steps - s >= RECENT_STEPS]:
            del self.last_seen[t]
        self.in_step.clear()

    def room(self, tenant: str) -> int:
        """Prefill tokens `tenant` may still add to this step: the whole budget if no other tenant is active."""
        if not self.last_seen.keys() - {tenant}:
            return self.step_budget
        return max(self.step_budget // SHARE_DIVISOR, 1) - self.in_step.get(tenant, 0)  # (a budget of 1 is no share)

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0) + tokens
        self.in_step[tenant] = self.in_step.get(tenant, 0) + tokens

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
