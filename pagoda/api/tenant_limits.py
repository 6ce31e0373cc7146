"""A tenant's limits (the keys file's `max_concurrent`, `requests_per_minute`, `tokens_per_minute`).

    admit(tenant, prompt tokens) -> Ticket   counted in flight; the request and its prompt tokens charged
                                 -> Refusal  429 with Retry-After, in the protocol's error shape
    Ticket.count(outputs)                    generated tokens charged as they come
    Ticket.release()                         out of flight (the request's one `finally`)

Design note. `max_concurrent` counts a tenant's HTTP requests in flight (a request with `n` choices is
one). The two per-minute limits are sliding windows over the last 60 seconds, kept in one-second buckets
(at most 60 per window, whatever the traffic). A request is refused while the window is *at or over* the
limit; a request that is admitted is charged whole: its prompt tokens at admission, its generated tokens
as they are produced, so a tenant may end a minute somewhat over `tokens_per_minute` and then waits until
enough of it has slid out of the window (its Retry-After says how long). A refusal touches no one else's
state: other tenants are admitted as before. Limits are read from the `Tenant` each time, so a reloaded
keys file applies at once; the counts are kept by tenant name, so a reload does not reset them.
All of it runs on the server's event loop: no locks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagoda.api.keys_file import Tenant
from pagoda.api.metrics import Metrics
from pagoda.core.outputs import AnswerDelta

WINDOW_SECONDS = 60.0


class Window:
    """Amounts added in the last `span` seconds, in one-second buckets."""

    def __init__(self, span: float = WINDOW_SECONDS) -> None:
        self.span = span
        self._buckets: deque[list[float]] = deque()  # [bucket start, amount], oldest first
        self._total = 0.0

    def add(self, now: float, amount: float) -> None:
        start = math.floor(now)
        if self._buckets and self._buckets[-1][0] == start:
            self._buckets[-1][1] += amount
        else:
            self._buckets.append([start, amount])
        self._total += amount

    def total(self, now: float) -> float:
        """The sum over the window ending at `now` (expired buckets dropped)."""
        while self._buckets and self._buckets[0][0] + self.span <= now:
            self._total -= self._buckets.popleft()[1]
        return self._total

    def seconds_until_below(self, limit: float, now: float) -> float:
        """How long until the window's sum is below `limit`, if nothing more is added."""
        total = self.total(now)
        if total < limit:
            return 0.0
        for start, amount in self._buckets:  # oldest first: the order they slide out
            total -= amount
            if total < limit:
                return start + self.span - now
        return self.span  # a limit <= 0 is never met (the keys file refuses one)


@dataclass
class TenantState:
    """What is counted for one tenant."""

    in_flight: int = 0
    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)


@dataclass(frozen=True)
class Refusal:
    """A request over one of its tenant's limits."""

    reason: str  # the limit's name: max_concurrent, requests_per_minute or tokens_per_minute
    retry_after: int  # whole seconds until a retry may be admitted (at least 1)
    message: str


class TenantLimits:
    """The limits of every tenant of one server, and their metrics."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.states: dict[str, TenantState] = {}

    def admit(self, tenant: Tenant, num_prompt_tokens: int) -> Ticket | Refusal:
        """A ticket for a request of `tenant` (release it when the request ends), or why not."""
        state = self.states.setdefault(tenant.name, TenantState())
        refusal = self._refusal(tenant, state, self.clock())
        if refusal is not None:
            self.metrics.tenant_rejected.labels(tenant=tenant.name, reason=refusal.reason).inc()
            self.metrics.rejected.labels(reason="tenant_limit").inc()
            return refusal
        now = self.clock()
        state.in_flight += 1
        state.requests.add(now, 1)
        state.tokens.add(now, num_prompt_tokens)
        self.metrics.tenant_requests.labels(tenant=tenant.name).inc()
        self.metrics.tenant_in_flight.labels(tenant=tenant.name).set(state.in_flight)
        self.metrics.tenant_tokens.labels(tenant=tenant.name, kind="prompt").inc(num_prompt_tokens)
        return Ticket(self, tenant, state)

    @staticmethod
    def _refusal(tenant: Tenant, state: TenantState, now: float) -> Refusal | None:
        if tenant.max_concurrent is not None and state.in_flight >= tenant.max_concurrent:
            return Refusal("max_concurrent", 1, f"tenant {tenant.name!r} has {state.in_flight} requests in flight,"
                                                f" its limit (max_concurrent); retry when one has finished")
        for name, limit, window in (("requests_per_minute", tenant.requests_per_minute, state.requests),
                                    ("tokens_per_minute", tenant.tokens_per_minute, state.tokens)):
            if limit is not None and window.total(now) >= limit:
                wait = max(1, math.ceil(window.seconds_until_below(limit, now)))
                return Refusal(name, wait, f"tenant {tenant.name!r} is at its {name} limit ({limit});"
                                           f" retry after {wait} s")
        return None


class Ticket:
    """One admitted request's place in its tenant's counts."""

    def __init__(self, limits: TenantLimits, tenant: Tenant, state: TenantState) -> None:
        self.limits = limits
        self.tenant = tenant
        self.state = state
        self.released = False

    async def count(self, outputs: AsyncIterator[AnswerDelta]) -> AsyncIterator[AnswerDelta]:
        """Pass one choice's outputs through, charging its generated tokens to the tenant as they come."""
        completion = self.limits.metrics.tenant_tokens.labels(tenant=self.tenant.name, kind="completion")
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.new_token_ids:
                    self.state.tokens.add(self.limits.clock(), len(out.new_token_ids))
                    completion.inc(len(out.new_token_ids))
                yield out

    def release(self) -> None:
        """The request is over (idempotent)."""
        if not self.released:
            self.released = True
            self.state.in_flight -= 1
            self.limits.metrics.tenant_in_flight.labels(tenant=self.tenant.name).set(self.state.in_flight)
