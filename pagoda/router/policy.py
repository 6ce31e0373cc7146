"""The policy seam: which replica serves a request.

Design note. A policy sees every replica, in the order of `--replica`, as a `ReplicaState` (whether
it is healthy, the requests this router has in flight there, its bound, and its latest /health
answer) and the request as a `RequestInfo`, and answers one replica's index:

    policy.choose(replicas, request) -> index

The router asks only when at least one replica is available (healthy and under its bound) and the
answer must be an available one: refusing (503 when none is healthy, 429 when all are full) is the
router's decision, not the policy's. Indices are stable, a replica keeps its index while it is down,
so a policy may keep state per replica (the prefix policy will keep an index of the block hashes it
sent to each). `choose` runs on the event loop, once per decision, and a policy's state changes only
there; a retry after a replica refused or could not be reached is a new decision, with that replica
unavailable.

`RequestInfo.block_hashes` is where the prompt's chained block hashes (the prefix cache's keys,
pagoda/core/block_hash.py) will travel once the router tokenizes prompts; until the prefix-aware
policy is wired in, the name `prefix` routes by least_load (and says so in the log).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("pagoda.router")

POLICIES = ("round_robin", "least_load", "prefix", "power_of_two")


@dataclass(frozen=True)
class ReplicaState:
    """One replica as a policy sees it at the moment of a decision."""

    index: int  # its place in --replica: stable for the router's life
    url: str
    healthy: bool  # its latest /health said ok, and no request to it has failed since
    in_flight: int  # requests this router has sent it that have not finished
    max_in_flight: int  # --max-queue-per-replica
    health: Mapping[str, Any] = field(default_factory=dict)  # its latest /health body (running, waiting, ...)

    @property
    def available(self) -> bool:
        """Whether it may be chosen now: healthy and under its bound."""
        return self.healthy and self.in_flight < self.max_in_flight


@dataclass(frozen=True)
class RequestInfo:
    """What the router knows of a request when it chooses."""

    method: str
    path: str
    protocol: str | None  # the endpoint's protocol name ("chat", "messages", ...); None for other routes
    body: bytes = b""  # the request body as the client sent it
    block_hashes: tuple[int, ...] = ()  # the prompt's chained block hashes: empty until the router tokenizes


class Policy(Protocol):
    """Chooses a replica; see the module's note for the contract."""

    name: str

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        """The index of an available replica (the router asks only when there is one)."""
        ...


def available(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas that may be chosen, in index order; never empty when a policy is asked."""
    found = [r for r in replicas if r.available]
    assert found, "a policy was asked with no replica available"
    return found


def least_in_flight(candidates: Sequence[ReplicaState]) -> int:
    """The index of the candidate with the fewest requests in flight; ties go to the lowest index."""
    return min(candidates, key=lambda r: (r.in_flight, r.index)).index


class RoundRobin:
    """Each replica in turn, skipping those unavailable: with all available, 0, 1, ..., N-1, 0, ..."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0  # the index whose turn it is

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        candidates = available(replicas)
        chosen = next((r for r in candidates if r.index >= self._next), candidates[0]).index
        self._next = (chosen + 1) % len(replicas)
        return chosen


class LeastLoad:
    """The available replica with the fewest requests in flight through this router, ties by index."""

    name = "least_load"

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        return least_in_flight(available(replicas))


class PowerOfTwo:
    """Two distinct available replicas drawn from a seeded RNG; the one with fewer in flight (ties: lower index)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        candidates = available(replicas)
        if len(candidates) == 1:
            return candidates[0].index
        return least_in_flight(self._rng.sample(candidates, 2))


def make_policy(name: str, seed: int = 0) -> Policy:
    """The named policy; ValueError for an unknown name. `prefix` is least_load until its live wiring lands."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "prefix":
        logger.warning("router policy 'prefix' is not wired into the live router yet: routing by least_load")
        return LeastLoad()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
