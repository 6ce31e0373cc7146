"""Scheduling policies: who is admitted from the waiting queue, who gets the step's tokens, who is preempted.

Design note. The scheduler (core/scheduler.py) owns the queues and the block ledger; a policy only answers
its questions, so no policy can break an invariant the audit checks, and because a request's sampling state
lives on the request, no policy changes an answer (only when it is computed). The questions:

    enqueue / requeue   where a new arrival / a preempted request goes in the waiting deque
    anticipation        seconds the engine should wait for a request before this step (0: none; fcfs: 0)
    start_step          once per schedule(), before anything is handed out (a policy's per-step state)
    rebalance           running requests to preempt so that better-placed waiting ones can run
    grant               how many of the step's tokens a request may take now (<= what it wants and the budget)
    next_waiting        the waiting request to admit next, one of the deque it is given (None: admit no more
                        this step); see its docstring for what the scheduler does when it then does not admit it
    victim              the running request to preempt when the pool is short of blocks

fcfs (the default) is today's schedule exactly: arrivals at the back, preempted requests at the front, the head
admitted first and nobody overtakes it, the newest running request preempted. Its methods are one line each, so
the step costs what it did.

priority keeps the waiting deque sorted by (priority, arrival): lower runs first, vLLM's meaning. A preempted
request goes to the front of its priority class. When every slot is taken and the head of the queue has a
better priority than the worst running request, that request (lowest priority, newest) is preempted for it.

fair shares running slots and step tokens between tenants (Request.tenant; None is one tenant) in proportion
to their weights (Request.weight; a tenant's is its latest request's):
  * slots: a tenant's normalised load is L = running / weight. Admission takes the waiting tenant whose L
    would be least with one more slot, (running + 1) / weight (ties: the one whose oldest waiting request came
    first), FIFO within a tenant; so the tenant a preemption made room for is admitted before the victim's. When every slot is
    taken, a waiting tenant t may take a slot from the running tenant u with the most L (its newest request is
    preempted) if L_t + 1/w_t < L_u: after the move t is still less loaded than u was, so the move is never
    undone and slots do not ping-pong (with <=, two tenants of equal weight would swap a slot every step).
    When no such move is left, every waiting tenant t and running tenant u have L_t + 1/w_t >= L_u; summing
    u's slots over all tenants gives running_t >= R * w_t / W - 1, where R is max_running and W the sum of the
    active tenants' weights: a backlogged tenant is never more than one slot short of its weighted share (when
    the pool and the budget let its requests be admitted).
  * tokens: each step the budget is water-filled over the tenants' demands (the uncomputed tokens of their
    running and waiting requests): every tenant gets min(its demand, its weighted share of what is left), and
    what a satisfied tenant leaves is shared again by weight, so the step is as full as fcfs would make it
    when demand allows. Integer rounding gives the left-over tokens to the tenants in the order of their
    weighted share owed (this step's fraction plus a carried deficit), so a tenant that wants its share gets at
    least floor(budget * w / W) tokens in a step, and over steps its share to within one token.
  * preemption for blocks takes the newest request of the tenant with the most L.
  * anticipation: a tenant whose last request ended in the step before (it ran then, and now has nothing
    running or waiting) keeps one slot empty for this one step, while anything else runs. A client in a loop
    sends its next request a few milliseconds after its answer ends; without the hold the slot goes to another
    tenant's queue head at once, and the returning request waits for that step (often a prompt) and then
    preempts it, wasting the work. And when the tenant came back within its hold the last time, the engine
    waits up to `anticipation_s` (10 ms) before the step for its next request (an arrival ends the wait), so
    that request does not wait out a whole step either. This is anticipatory scheduling (Iyer and Druschel,
    SOSP 2001), with its rule of waiting only for a client whose history says it will come back: a tenant that
    leaves for good costs one held slot for one step, and at most one wait. The policy is not work-conserving
    by one slot per departed tenant for one step, and never empties a step (with nothing else running the slot
    is not held). The share bound above is unchanged: it is stated while every tenant is backlogged, and a
    held tenant is not.
This is weighted max-min fairness recomputed every step (deficit round robin with one round per step, its
quantum the weighted share of the budget). The shares themselves are recomputed from every tenant's whole demand
each step; what is carried between steps is a backlogged tenant's deficit (`FairPolicy.carry`: the fractions of
its shares that integer rounding has not yet given it), dropped once a step meets its whole demand.

A third-party package adds a policy by registering its class through the `pagoda_register_scheduling_policies`
hook (pagoda/plugins/hookspecs.py); `pagoda serve --scheduling-policy NAME` picks it. No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import islice

from pagoda.core.request import Request


class SchedulingPolicy:
    """The interface, with fcfs's answers: subclass it and override the decisions that differ."""

    name = "fcfs"
    description = "first come, first served: arrival order, the newest running request preempted"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        """Put a new arrival into the waiting queue."""
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """Put a preempted request back into the waiting queue."""
        waiting.appendleft(request)

    def anticipation(self, running: Sequence[Request], waiting: deque[Request]) -> float:
        """Seconds the engine should wait for an arrival before this step's schedule (an arrival ends the wait)."""
        return 0.0

    def start_step(self, running: Sequence[Request], waiting: deque[Request], budget: int, max_running: int) -> None:
        """Called once at the top of every schedule(), before any other decision of the step."""

    def rebalance(self, running: Sequence[Request], waiting: deque[Request], max_running: int) -> list[Request]:
        """Running requests to preempt (in order) so that waiting ones the policy prefers can be admitted."""
        return []

    def grant(self, request: Request, wanted: int, budget: int) -> int:
        """Tokens `request` may compute this step (0..min(wanted, budget)); the policy counts them as given."""
        return wanted if wanted < budget else budget

    def next_waiting(self, waiting: deque[Request], running: Sequence[Request]) -> Request | None:
        """The waiting request to admit next, one of `waiting` (None: admit no more this step).

        The contract. The scheduler then asks `grant` for the request's first chunk and checks that chunk's blocks
        and the LoRA rule (core/scheduler.py). If all allow it, the request leaves `waiting` and runs. If not, the
        request stays in the scheduler's waiting queue where it was: still WAITING, holding no blocks and no
        computed tokens. Nothing tells the policy, and the tokens `grant` gave it stay counted as given. When
        `grant` gave it no token or the blocks are short, the scheduler admits nobody else this step. When only
        its adapter held it back (one too many), the scheduler goes on admitting base requests alone: it asks
        again with `waiting` a new deque holding only the waiting queue's base requests, in its order (and the
        same deque, less each one admitted, until the step's admission ends), so a policy must pick from the
        `waiting` it is given.

        So a policy may commit per-step state here as though the request were admitted (fair takes it off its
        own queue and counts it as running) as long as `start_step` rebuilds that state from `running` and
        `waiting`: until the next `start_step` the policy hears only `enqueue` (new arrivals) and `anticipation`
        (before the next schedule).
        """
        return waiting[0] if waiting else None

    def victim(self, candidates: Sequence[Request], running: Sequence[Request]) -> Request:
        """Which of `candidates` (the running requests not yet given a chunk this step) to preempt for blocks."""
        return candidates[-1]


FcfsPolicy = SchedulingPolicy


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` first, ties by arrival; the lowest-priority, newest running request is preempted."""

    name = "priority"
    description = "per-request priority (lower first, ties by arrival); preempts the lowest-priority, newest"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        i = len(waiting)  # behind every request of the same or a better priority: search from the back
        while i > 0 and waiting[i - 1].priority > request.priority:
            i -= 1
        waiting.insert(i, request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        i = 0  # ahead of every request of the same or a worse priority: it arrived before them
        while i < len(waiting) and waiting[i].priority < request.priority:
            i += 1
        waiting.insert(i, request)

    def rebalance(self, running: Sequence[Request], waiting: deque[Request], max_running: int) -> list[Request]:
        if len(running) < max_running or not waiting:
            return []
        victims: list[Request] = []
        candidates = list(running)
        for head in islice(waiting, len(running)):  # the best waiting ones, each against the worst running left
            if not candidates:
                break
            worst = self.victim(candidates, running)
            if worst.priority <= head.priority:
                break
            candidates.remove(worst)
            victims.append(worst)
        return victims

    def victim(self, candidates: Sequence[Request], running: Sequence[Request]) -> Request:
        worst = candidates[-1]
        for request in reversed(candidates):  # the newest of the worst priority
            if request.priority > worst.priority:
                worst = request
        return worst


class FairPolicy(SchedulingPolicy):
    """Running slots and step tokens shared between tenants by weight (the module's design note)."""

    name = "fair"
    description = "tenants share running slots and step tokens by weight; preempts from the most over its share"
    anticipation_s = 0.010  # the longest wait for a departed tenant's next request (the design note)

    def __init__(self) -> None:
        self.weights: dict[str | None, float] = {}  # tenant -> its latest request's weight
        self.running_count: dict[str | None, int] = {}  # this step, kept as requests are admitted and preempted
        self.queues: dict[str | None, deque[Request]] = {}  # this step: each tenant's waiting requests, in order
        self.queued_from: deque[Request] | None = None  # the waiting deque `queues` was split from
        self.grants: dict[str | None, int] = {}  # this step: tokens each tenant may still take
        self.carry: dict[str | None, float] = {}  # tokens the rounding owes each backlogged tenant (water_fill)
        self.held: set[str | None] = set()  # this step: tenants whose last request ended in the step before
        self.came_back: dict[str | None, bool] = {}  # whether a tenant's next request came within its last hold
        self.max_running = 0

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        self.weights[request.tenant] = request.weight
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)
        self.running_count[request.tenant] = self.running_count.get(request.tenant, 1) - 1
        queue = self.queues.get(request.tenant)
        if queue is None:
            self.queues[request.tenant] = deque([request])
        else:
            queue.appendleft(request)

    def _weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, 1.0)

    def _load(self, tenant: str | None) -> float:
        return self.running_count.get(tenant, 0) / self._weight(tenant)

    def anticipation(self, running: Sequence[Request], waiting: deque[Request]) -> float:
        if not (running or waiting):
            return 0.0  # nothing else to do: the engine is idle until a request comes anyway
        ran = {t for t, n in self.running_count.items() if n > 0 and self.came_back.get(t, False)}
        departed = ran - {r.tenant for r in running} if ran else ran  # most steps end here: it still runs
        if departed:
            departed -= {r.tenant for r in waiting}  # ran, and nothing of it runs or waits now
        return self.anticipation_s if departed else 0.0

    def start_step(self, running: Sequence[Request], waiting: deque[Request], budget: int, max_running: int) -> None:
        demand: dict[str | None, int] = {}
        ran = {t for t, n in self.running_count.items() if n > 0}  # at the end of the step before
        self.max_running = max_running
        self.running_count = {}
        for r in running:
            self.running_count[r.tenant] = self.running_count.get(r.tenant, 0) + 1
            demand[r.tenant] = demand.get(r.tenant, 0) + r.num_tokens - r.num_computed_tokens
        self.queues, self.queued_from = {}, waiting
        for r in waiting:
            queue = self.queues.get(r.tenant)
            if queue is None:
                self.queues[r.tenant] = queue = deque()
            queue.append(r)
            if demand.get(r.tenant, 0) < budget:
                demand[r.tenant] = demand.get(r.tenant, 0) + r.num_tokens
        self.grants = water_fill(budget, demand, {t: self._weight(t) for t in demand}, self.carry)
        for t in self.held:  # held in the step before: did its next request come within the hold?
            self.came_back[t] = t in demand
        for t in ran - self.running_count.keys():  # its requests ended and its next came before this schedule
            if t in self.queues:
                self.came_back[t] = True
        self.held = ran - demand.keys()  # ran then, nothing running or waiting now: its slot is held this step

    def _free_slots(self, running: Sequence[Request]) -> int:
        """Slots another tenant may take now: the held ones are kept while something else runs."""
        free = self.max_running - len(running)
        return free - len(self.held) if running else free

    def rebalance(self, running: Sequence[Request], waiting: deque[Request], max_running: int) -> list[Request]:
        """Preempt while a waiting tenant t and a running tenant u have L_t + 1/w_t < L_u (slots full)."""
        if not waiting:
            return []
        free = self._free_slots(running)
        load = dict(self.running_count)
        queued = {t: len(q) for t, q in self.queues.items()}
        by_tenant: dict[str | None, list[Request]] = {}
        for r in running:
            by_tenant.setdefault(r.tenant, []).append(r)
        victims: list[Request] = []
        for _ in range(len(waiting)):  # each pass admits (virtually) one waiting request or stops
            waiting_tenants = [t for t, n in queued.items() if n > 0]
            if not waiting_tenants:
                break
            t = min(waiting_tenants, key=lambda x: ((load.get(x, 0) + 1) / self._weight(x), self.queues[x][0].arrival_time))
            if free <= 0:
                u = max(by_tenant, key=lambda x: load.get(x, 0) / self._weight(x), default=None)
                if u is None or not by_tenant[u]:
                    break
                if (load.get(t, 0) + 1) / self._weight(t) >= load[u] / self._weight(u):
                    break
                victims.append(by_tenant[u].pop())
                if not by_tenant[u]:
                    del by_tenant[u]
                load[u] -= 1
                free += 1
            load[t] = load.get(t, 0) + 1
            queued[t] -= 1
            free -= 1
        return victims

    def grant(self, request: Request, wanted: int, budget: int) -> int:
        left = self.grants.get(request.tenant, 0)
        n = min(wanted, budget, left)
        self.grants[request.tenant] = left - n
        return n

    def next_waiting(self, waiting: deque[Request], running: Sequence[Request]) -> Request | None:
        if self._free_slots(running) <= 0:
            return None
        if waiting is not self.queued_from:  # the scheduler's view of its base requests (the interface's contract)
            self.queues, self.queued_from = {}, waiting
            for r in waiting:
                self.queues.setdefault(r.tenant, deque()).append(r)
        best, best_key = None, None
        for tenant, queue in self.queues.items():
            if not queue or self.grants.get(tenant, 0) <= 0:
                continue
            key = ((self.running_count.get(tenant, 0) + 1) / self._weight(tenant), queue[0].arrival_time)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        if best_key is None:  # no tenant may start one (None is a tenant: the requests that name none)
            return None
        # Counted as admitted now (the interface's contract): if the scheduler then does not admit it, this step
        # admits no one else, and `start_step` rebuilds the queues, counts and grants from the scheduler's own
        # queues. Until then its tenant counts one running request more than it has, and `anticipation` and
        # `start_step` read those counts to tell which tenants ran in the step before (the hold and the wait): such
        # a tenant counts as having run.
        request = self.queues[best].popleft()
        self.running_count[best] = self.running_count.get(best, 0) + 1
        return request

    def victim(self, candidates: Sequence[Request], running: Sequence[Request]) -> Request:
        worst = candidates[-1]
        for request in reversed(candidates):  # the newest request of the most loaded tenant
            if self._load(request.tenant) > self._load(worst.tenant):
                worst = request
        return worst


def water_fill(budget: int, demand: Mapping[str | None, int], weights: Mapping[str | None, float],
               carry: dict[str | None, float] | None = None) -> dict[str | None, int]:
    """Weighted max-min fair integer shares of `budget`: each key gets min(its demand, its weighted share of what
    the satisfied ones leave). The rounding remainder goes to the unsatisfied keys with the most owed: the
    fraction of their share this round plus what `carry` (updated in place, deficit round robin's counter)
    says earlier rounds owe them, so a small share is not rounded to nothing step after step."""
    carry = {} if carry is None else carry
    grants = {t: 0 for t in demand}
    hungry = [t for t, d in demand.items() if d > 0]
    left = budget
    while hungry and left > 0:
        total = sum(weights[t] for t in hungry)
        shares = {t: left * weights[t] / total for t in hungry}
        satisfied = [t for t in hungry if demand[t] - grants[t] <= shares[t]]
        if satisfied:
            for t in satisfied:
                left -= demand[t] - grants[t]
                grants[t] = demand[t]
                carry.pop(t, None)  # not backlogged: nothing is owed
            hungry = [t for t in hungry if t not in satisfied]
            continue
        owed = {t: shares[t] + carry.get(t, 0.0) for t in hungry}
        given = {t: int(shares[t]) for t in hungry}
        for t in sorted(hungry, key=lambda x: -(owed[x] - given[x]))[: left - sum(given.values())]:
            given[t] += 1
        for t in hungry:
            grants[t] += given[t]
            carry[t] = owed[t] - given[t]
        left = 0
    return grants


BUILTIN_POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    p.name: p for p in (SchedulingPolicy, PriorityPolicy, FairPolicy)
}


def make_policy(name: str, policies: Mapping[str, Callable[[], SchedulingPolicy]] | None = None) -> SchedulingPolicy:
    """A fresh policy (it may keep per-scheduler state) by name; an unknown name is a ValueError naming the choices."""
    policies = BUILTIN_POLICIES if policies is None else policies
    if not policies:
        raise ValueError(f"scheduling policy {name!r}: no scheduling policy is registered (is the "
                         "scheduling_policies plugin left out?)")
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(sorted(policies))}")
    return policies[name]()
