"""The policy seam: which replica serves a request.

Design note. A policy sees every replica, in the order of `--replica`, as a `ReplicaState` (whether
it is healthy, the requests this router has in flight there, its bound, and its latest /health
answer) and the request as a `RequestInfo`, and answers one replica's index:

    policy.choose(replicas, request) -> index

The router asks only when at least one replica is available (healthy and under its bound) and the
answer must be an available one: refusing (503 when none is healthy, 429 when all are full) is the
router's decision, not the policy's. Indices are stable, a replica keeps its index while it is down,
so a policy may keep state per replica. `choose` runs on the event loop, once per decision, and a
policy's state changes only there; a retry after a replica refused or could not be reached is a new
decision, with that replica unavailable.

Round robin, least load and power of two are small enough to be written here over the available
replicas. `prefix` is the fleet's own policy from `pagoda.core.routing.PrefixAware` (the one the
simulator's fleet runs, so that its predictions are about this code): a policy whose `reads_prompt`
is true gets the prompt in `RequestInfo.prompt` (its rendered tokens, `cache_salt` and tenant, read
by router/prompts.py as a replica reads them), and keys on the prompt's chained block hashes by the
prefix cache's own function (pagoda/core/block_hash.py). The block size and each replica's index
capacity (its pool's blocks) come from the replicas' /health.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import (BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD, POLICIES, PrefixAware,
                                 RouteRequest)

logger = logging.getLogger("pagoda.router")



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
    prompt: RouteRequest | None = None  # its rendered prompt and cache keys, for a policy that `reads_prompt`


class Policy(Protocol):
    """Chooses a replica; see the module's note for the contract."""

    name: str
    reads_prompt: bool  # whether the router must render the prompt (RequestInfo.prompt) before asking

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
    reads_prompt = False

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
    reads_prompt = False

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        return least_in_flight(available(replicas))


class PowerOfTwo:
    """Two distinct available replicas drawn from a seeded RNG; the one with fewer in flight (ties: lower index)."""

    name = "power_of_two"
    reads_prompt = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        candidates = available(replicas)
        if len(candidates) == 1:
            return candidates[0].index
        return least_in_flight(self._rng.sample(candidates, 2))


class Prefix:
    """The longest prefix the replica's index holds, balanced by thresholds (pagoda.core.routing.PrefixAware);
    a request whose prompt the router could not read (not a generation route, or a body the replica will
    refuse) goes to the least loaded, as a prompt with no match does."""

    name = "prefix"
    reads_prompt = True

    def __init__(self, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, cache_threshold: float = CACHE_THRESHOLD) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.reasons: dict[str, int] = {}  # decisions by PrefixAware's reason ("match", "low_match", "no_match", "balance")
        self._inner: PrefixAware | None = None

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        candidates = [r.index for r in available(replicas)]
        if request.prompt is None:
            return least_in_flight([replicas[i] for i in candidates])
        inner = self._index(replicas)
        route = inner.route(request.prompt, [r.in_flight for r in replicas], candidates)
        self.reasons[route.reason] = self.reasons.get(route.reason, 0) + 1
        return route.replica

    def _index(self, replicas: Sequence[ReplicaState]) -> PrefixAware:
        """The per-replica index, made at the first decision from what the replicas' /health says: their block
        size (the prefix cache's unit) and the smallest pool (the index's capacity, per replica)."""
        if self._inner is None:
            said = [r.health for r in replicas if "kv_block_size" in r.health]
            block_size = int(said[0]["kv_block_size"]) if said else EngineConfig.block_size
            if len({int(h["kv_block_size"]) for h in said}) > 1:
                logger.warning("replicas differ in KV block size; the prefix index keys on %d-token blocks", block_size)
            pools = [int(r.health["kv_blocks_total"]) for r in replicas if "kv_blocks_total" in r.health]
            self._inner = PrefixAware(len(replicas), block_size, min(pools) if pools else EngineConfig.num_blocks,
                                      self.balance_abs_threshold, self.balance_rel_threshold, self.cache_threshold)
        return self._inner


def make_policy(name: str, seed: int = 0, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                balance_rel_threshold: float = BALANCE_REL_THRESHOLD, cache_threshold: float = CACHE_THRESHOLD) -> Policy:
    """The named policy; ValueError for an unknown name."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "prefix":
        return Prefix(balance_abs_threshold, balance_rel_threshold, cache_threshold)
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
