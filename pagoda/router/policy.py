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

The built-in policies are core's (`pagoda.core.routing`, the ones the simulator's fleet runs, so
that its predictions are about this code): `BuiltinPolicy` hands one the replicas' requests in
flight as its loads and the available replicas as those it may choose. A policy whose
`reads_prompt` is true (`prefix`) gets the prompt in `RequestInfo.prompt` (its rendered tokens,
`cache_salt`, tenant and the LoRA adapter its `model` names, read by router/prompts.py as a replica reads them), and keys on the
prompt's chained block hashes by the prefix cache's own function (pagoda/core/block_hash.py). The
block size and each replica's index capacity (its pool's blocks) come from the replicas' /health.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import (BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD, RouteRequest,
                                 RouterPolicy, check_router_policy, least_loaded, make_router_policy)

logger = logging.getLogger("pagoda.router")
NO_PROMPT = RouteRequest(())  # what a policy that reads no prompt is handed


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
    # the LoRA adapter its `model` names, when a replica serves one by that name (None: the base model); only
    # replicas that list it are offered to the policy (Fleet.admit)
    adapter: str | None = None


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


class BuiltinPolicy:
    """A routing policy of pagoda.core.routing behind the seam: each replica's requests in flight are its load, the
    available replicas are those it may choose. It is made at the first decision, when the replicas' /health has
    said their block size (the prefix cache's unit) and their pools (the smallest is prefix's index capacity,
    per replica). A request whose prompt a prompt-reading policy could not read (not a generation route, or a
    body the replica will refuse) goes to the least loaded, as a prompt with no match does, and is not counted
    in `reasons`."""

    def __init__(self, name: str, seed: int = 0, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 cache_threshold: float = CACHE_THRESHOLD) -> None:
        self.name = check_router_policy(name)
        self.reads_prompt = name == "prefix"
        self.seed = seed
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.reasons: dict[str, int] = {}  # decisions by RoutingDecision.reason (prefix's: match, no_match, ...)
        self._inner: RouterPolicy | None = None

    def choose(self, replicas: Sequence[ReplicaState], request: RequestInfo) -> int:
        candidates = [r.index for r in available(replicas)]
        loads = [r.in_flight for r in replicas]
        if self.reads_prompt and request.prompt is None:
            return least_loaded(loads, candidates)
        decision = self._core_policy(replicas).route(request.prompt or NO_PROMPT, loads, candidates)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        return decision.replica

    def _core_policy(self, replicas: Sequence[ReplicaState]) -> RouterPolicy:
        """The core policy over these replicas, made at the first decision from what their /health says."""
        if self._inner is None:
            said = [r.health for r in replicas if "kv_block_size" in r.health]
            block_size = int(said[0]["kv_block_size"]) if said else EngineConfig.block_size
            if self.reads_prompt and len({int(h["kv_block_size"]) for h in said}) > 1:
                logger.warning("replicas differ in KV block size; the prefix index keys on %d-token blocks", block_size)
            pools = [int(r.health["kv_blocks_total"]) for r in replicas if "kv_blocks_total" in r.health]
            self._inner = make_router_policy(self.name, len(replicas), block_size,
                                             min(pools) if pools else EngineConfig.num_blocks, self.seed,
                                             self.balance_abs_threshold, self.balance_rel_threshold,
                                             self.cache_threshold)
        return self._inner
