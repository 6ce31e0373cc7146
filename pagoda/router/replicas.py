"""The replicas behind a router: each one's client, health and requests in flight, and admission.

Design note. Health is polled (`poll_forever`: each replica's /health every `health_interval`
seconds, each on its own loop): a replica is healthy when its /health answers 200 with status "ok"; down,
draining (503) or slower than `health_timeout` it is routed around until a poll says ok again. A
request that finds a replica unreachable, or that a replica refuses with 503, marks it unhealthy at
once, so traffic leaves a dead replica before the next poll notices. Requests in flight are counted
here, through `Fleet.admit`, which is the bounded queue: a context manager that picks a replica with
the policy among those healthy and under `max_queue_per_replica`, counts the request there, and
uncounts it when its `with` block ends, whatever the way out. Choosing and counting happen with no
await in between, so on the router's one event loop two requests never both take a replica's last slot.

LoRA adapters. A request whose `model` names an adapter some replica's latest /health lists (`lora_adapters`)
may go only to those replicas: the others would answer it 404 (or, had they an adapter of that name loaded from
elsewhere, answer it differently). So `admit` offers the policy only them, and refuses (503, 429) when none of
them may take it now, rather than send it where the adapter is not. `admit_all` is the other way round: an
adapter's load or unload goes to every healthy replica at once (router/proxy.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagoda.router.policy import Policy, ReplicaState, RequestInfo

logger = logging.getLogger("pagoda.router")

# the /health fields a router sums over its healthy replicas, besides every integer `*_total` counter
SUMMED_FIELDS = ("running", "waiting", "kv_blocks_total", "kv_blocks_free")
ADAPTERS_FIELD = "lora_adapters"  # a replica's /health: the LoRA adapters it serves (adapter_names reads it)


def adapter_names(health: Mapping[str, Any]) -> frozenset[str]:
    """The LoRA adapters a replica's /health says requests may name: `lora_adapters`, a list of objects with a
    "name" (pagoda.api.health), less those being unloaded; none when it says nothing."""
    said = health.get(ADAPTERS_FIELD)
    if not isinstance(said, list):
        return frozenset()
    return frozenset(item["name"] for item in said if isinstance(item, Mapping) and isinstance(item.get("name"), str)
                     and item["name"] and not item.get("unloading"))


@dataclass
class Replica:
    """One replica: where it is, what its /health last said, and the requests in flight to it."""

    index: int
    url: str
    max_in_flight: int
    client: httpx.AsyncClient | None = None  # its connection pool, opened on the router's event loop
    in_flight: int = 0
    healthy: bool = False  # until the first poll says ok
    status: str = "unknown"  # "ok", the replica's own word ("draining", "unavailable"), or "unreachable"
    health: dict[str, Any] = field(default_factory=dict)  # its latest /health body
    error: str | None = None  # why it is not healthy, when it is not

    def state(self) -> ReplicaState:
        return ReplicaState(self.index, self.url, self.healthy, self.in_flight, self.max_in_flight, self.health)

    def mark_down(self, status: str, error: str) -> None:
        """A poll or a request found it unable to serve: route around it until a poll says ok again."""
        if self.healthy:
            logger.warning("replica %s is %s: %s", self.url, status, error)
        self.healthy, self.status, self.error = False, status, error

    def describe(self) -> dict[str, Any]:
        """Its entry in the router's /health: its own /health fields, then the router's view of it."""
        view = {**self.health, "url": self.url, "status": self.status, "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight}
        return view if self.error is None else {**view, "error": self.error}


class Refused(Exception):
    """No replica may take the request: `status` 503 (none healthy, or the router is draining) or 429 (every healthy
    one full); `code` names which, as the error's code."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class Fleet:
    """The replicas, the policy that chooses among them, and their health."""

    def __init__(self, urls: Sequence[str], policy: Policy, max_in_flight: int) -> None:
        self.replicas = [Replica(i, url, max_in_flight) for i, url in enumerate(urls)]
        self.policy = policy
        self.draining = False  # set once, by drain(): every new request is refused with a 503
        self._idle: asyncio.Event | None = None  # while draining: set when the last request in flight ends

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests from now on and wait, up to `timeout` s, for those in flight to end."""
        self.draining = True
        if self.in_flight == 0:
            return
        self._idle = asyncio.Event()
        logger.info("draining: refusing new requests, waiting up to %g s for the %d in flight", timeout, self.in_flight)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("shutdown timeout (%g s): %d requests in flight are cut", timeout, self.in_flight)

    @property
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def adapter_names(self) -> frozenset[str]:
        """The LoRA adapters any replica's latest /health lists (prefix keys a prompt under the one its `model`
        names, router/prompts.py). Read from the prompt reader's worker thread: each poll replaces a replica's
        `health` whole, so a read sees one poll's answer or the next."""
        return frozenset().union(*(adapter_names(r.health) for r in self.replicas))

    @contextmanager
    def admit(self, request: RequestInfo, exclude: frozenset[int] = frozenset()) -> Iterator[Replica]:
        """`with fleet.admit(request) as replica:` the replica the policy picks, leaving out `exclude` (those this
        request already tried) and, for a request naming a LoRA adapter some replica lists, every replica that does
        not list it, with the request counted in flight there until the block ends; Refused if none may."""
        if self.draining:
            raise Refused(503, "the router is shutting down and takes no new requests; retry", "draining")
        holders = {r.index for r in self.replicas if request.adapter is not None
                   and request.adapter in adapter_names(r.health)}
        left_out = exclude | ({r.index for r in self.replicas} - holders if holders else frozenset())
        states = [r.state() for r in self.replicas]
        states = [s if s.index not in left_out else ReplicaState(s.index, s.url, False, s.in_flight,
                                                                 s.max_in_flight, s.health) for s in states]
        which = f"replica serving the LoRA adapter {request.adapter!r}" if holders else "replica"
        if not any(s.healthy for s in states):
            raise Refused(503, f"no {which} can serve this request now (none is healthy)", "no_healthy_replica")
        if not any(s.available for s in states):
            bound = self.replicas[0].max_in_flight
            raise Refused(429, f"every healthy {which} has {bound} requests in flight; retry later", "queue_full")
        index = self.policy.choose(states, request)
        assert states[index].available, f"policy {self.policy.name} chose replica {index}, which is not available"
        with self._counted([self.replicas[index]]):
            yield self.replicas[index]

    @contextmanager
    def admit_all(self) -> Iterator[list[Replica]]:
        """`with fleet.admit_all() as replicas:` every healthy replica, each counting the request in flight until the
        block ends, whatever its bound (an adapter's load or unload must reach them all); Refused (503) while draining
        or when none is healthy."""
        if self.draining:
            raise Refused(503, "the router is shutting down and takes no new requests; retry", "draining")
        healthy = self.healthy
        if not healthy:
            raise Refused(503, "no replica can serve this request now (none is healthy)", "no_healthy_replica")
        with self._counted(healthy):
            yield healthy

    @contextmanager
    def _counted(self, replicas: list[Replica]) -> Iterator[None]:
        """One request in flight on each of `replicas` until the block ends; a drain hears of the last ending."""
        for replica in replicas:
            replica.in_flight += 1
        try:
            yield
        finally:
            for replica in replicas:
                replica.in_flight -= 1
                assert replica.in_flight >= 0, (replica.url, replica.in_flight)
            if self._idle is not None and self.in_flight == 0:
                self._idle.set()

    async def poll_once(self, http: httpx.AsyncClient, timeout: float) -> None:
        """Ask every replica's /health at once and record what each said."""
        await asyncio.gather(*(self._poll(replica, http, timeout) for replica in self.replicas))

    async def poll_forever(self, http: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Each replica's /health every `interval` seconds, until cancelled; one loop each, so that a replica
        slow to answer delays no other's."""
        async def poll_one(replica: Replica) -> None:
            while True:
                await asyncio.sleep(interval)
                await self._poll(replica, http, timeout)

        await asyncio.gather(*(poll_one(replica) for replica in self.replicas))

    async def refresh(self, replicas: Sequence[Replica], timeout: float) -> None:
        """Ask these replicas' /health now, each on its own connection pool (after a change the router made)."""
        await asyncio.gather(*(self._poll(r, r.client, timeout) for r in replicas if r.client is not None))

    @staticmethod
    async def _poll(replica: Replica, http: httpx.AsyncClient, timeout: float) -> None:
        try:
            response = await http.get(f"{replica.url}/health", timeout=timeout)
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            replica.mark_down("unreachable", f"/health: {type(exc).__name__}: {exc}")
            return
        if not isinstance(body, dict):
            replica.mark_down("unreachable", f"/health answered {response.status_code} with no JSON object")
            return
        replica.health = body
        status = str(body.get("status", f"http {response.status_code}"))
        if response.status_code == 200 and status == "ok":
            if not replica.healthy:
                logger.info("replica %s is healthy", replica.url)
            replica.healthy, replica.status, replica.error = True, "ok", None
        else:
            replica.mark_down(status, str(body.get("error", f"/health answered {response.status_code} {status}")))

    def summary(self) -> dict[str, Any]:
        """The router's /health body: a server's fields summed over the healthy replicas, then each replica."""
        healthy = self.healthy
        sums: dict[str, int] = {name: 0 for name in SUMMED_FIELDS}
        for replica in healthy:
            for name, value in replica.health.items():
                if (name in SUMMED_FIELDS or name.endswith("_total")) and type(value) is int:
                    sums[name] = sums.get(name, 0) + value
        status = "draining" if self.draining else "ok" if healthy else "unavailable"
        return {"status": status, **sums, "policy": self.policy.name,
                "replicas_healthy": len(healthy), "in_flight": self.in_flight,
                "replicas": [r.describe() for r in self.replicas]}
