"""Routing policies: which replica of a fleet serves a request.

Design note. A router sees, per request, its prompt tokens and cache keys
(`cache_salt`, tenant, the LoRA adapter it asks for), and per replica one load number (requests sent there
and not yet answered); it answers a replica index. It cannot see a replica's prefix
cache, so the `prefix` policy keeps its own approximate index per replica, as
SGLang's cache-aware router keeps a radix tree per worker: the chained block
hashes of every prompt it sent there, least recently routed evicted first once
the index holds as many blocks as the replica's pool. The hashes are the
engine's own (`core/block_hash.py`, on a request holding the prompt), so salt,
tenant and adapter separate prompts here exactly as they do in the cache: a
conversation under adapter X follows X's cached turns, and the same prompt under
adapter Y or the base model matches none of them.

`prefix` in the spirit of SGLang's cache-aware policy: when the loads are
imbalanced beyond BOTH an absolute and a relative threshold
(max - min > `balance_abs_threshold` and max > `balance_rel_threshold` * min),
it sends the request to the least loaded replica; otherwise to the replica
whose index matches the longest prefix of the prompt (ties: the less loaded,
then the lower index), and when no replica matches at least `cache_threshold`
of the prompt's full blocks (SGLang's cache_threshold) to the least loaded. So a
conversation's later turns follow its cached history, but a new conversation
that shares only a short system prompt with others is spread, not piled onto
the one replica that served the first. Where it
falls back to the least loaded, ties go to the replica whose index holds the
fewest blocks (SGLang sends a miss to the smallest tree: the emptiest cache,
so a new prefix does not evict a warm one while another replica sits cold),
then to the lower index. So the replica it picks never holds more than
max(min + abs, rel * min) requests.

Every policy answers `route(request, loads, eligible)`: `loads` holds one number per
replica, `eligible` the replicas it may choose now (default: all). The simulator's fleet
passes every replica; the live router passes those healthy and under their bound, and the
loads of the others take no part. Each `route` is one decision, and a policy's state (its
turn, its RNG, its index) changes only there.

Policies live in core because core is the one room that both the simulator's fleet
(simulator/fleet.py, which may import core alone) and the live router (router/policy.py,
whose `choose(replicas, request)` seam hands each replica's requests in flight as `loads`)
may import: bookkeeping only, no torch. Both run these classes, made by
`make_router_policy`, so the simulator predicts for the code the router runs.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.core import block_hash
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams

POLICIES = ("round_robin", "least_load", "prefix", "power_of_two")
# SGLang's router defaults are 64 requests and 1.5x, for workers that run hundreds of requests at once. Here the
# absolute threshold is 4 requests: the simulated fleets (docs/distributed.md, 16 and 64 replicas on the agent
# crowd) and the live chat fleet (docs/performance/2026-12-03-fleet-router.md) kept all of prefix's hit rate
# with it, while at a whole batch (16) a crowd sharing one system prompt piled onto the one replica that served
# it first. The simulator's own fleet defaults to its replicas' max_running (FleetConfig).
BALANCE_ABS_THRESHOLD = 4
BALANCE_REL_THRESHOLD = 1.5
# SGLang's cache_threshold: below this share of the prompt's blocks matched, a match is not worth following
# (a new conversation that shares only the system prompt goes where the load and the emptiest index say)
CACHE_THRESHOLD = 0.3


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request: its prompt and the keys its cached blocks are shared under."""

    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None
    tenant: str | None = None
    adapter: str | None = None  # the LoRA adapter its rows add (None: the base model); its KV is its own


@dataclass(frozen=True)
class RoutingDecision:
    """One decision: the replica, why (a policy name, or prefix's "match", "low_match", "no_match", "balance"), and
    how many of the prompt's full blocks the chosen replica's index already held."""

    replica: int
    reason: str
    matched_blocks: int = 0


def check_router_policy(name: str) -> str:
    """The name when it is a routing policy's; ValueError naming the choices otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
    return name


def candidates_of(num_replicas: int, eligible: Sequence[int] | None) -> list[int]:
    """The replicas a decision may choose, in index order: `eligible`, or all; ValueError when there are none."""
    candidates = list(range(num_replicas)) if eligible is None else sorted(eligible)
    if not candidates:
        raise ValueError("no replica is eligible")
    return candidates


def least_loaded(loads: Sequence[int], candidates: Sequence[int]) -> int:
    """The candidate with the fewest requests; ties go to the lowest index."""
    return min(candidates, key=lambda r: (loads[r], r))


def prompt_block_hashes(request: RouteRequest, block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, by the prefix cache's own function and keys."""
    held = Request("route", list(request.prompt_token_ids), SamplingParams(), cache_salt=request.cache_salt,
                   tenant=request.tenant, adapter=request.adapter)
    return block_hash.block_hashes(held, block_size, len(held.prompt_token_ids) // block_size)


class RoundRobin:
    """Each eligible replica in turn: with all eligible, 0, 1, ..., N-1, 0, ..., so assignment counts never differ
    by more than one; a replica that is not eligible in its turn is skipped."""

    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._next = 0  # the index whose turn it is

    def route(self, request: RouteRequest, loads: Sequence[int],
              eligible: Sequence[int] | None = None) -> RoutingDecision:
        """One decision: whose turn it is, or the next eligible one after it."""
        candidates = candidates_of(self.num_replicas, eligible)
        replica = next((r for r in candidates if r >= self._next), candidates[0])
        self._next = (replica + 1) % self.num_replicas
        return RoutingDecision(replica, self.name)


class LeastLoad:
    """The eligible replica with the fewest requests (running + waiting, or in flight), ties by index."""

    name = "least_load"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    def route(self, request: RouteRequest, loads: Sequence[int],
              eligible: Sequence[int] | None = None) -> RoutingDecision:
        """One decision: the least loaded."""
        return RoutingDecision(least_loaded(loads, candidates_of(self.num_replicas, eligible)), self.name)


class PowerOfTwo:
    """Two distinct eligible replicas drawn from a seeded RNG; the less loaded of the two (ties: the lower index)."""

    name = "power_of_two"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        self.num_replicas = num_replicas
        self._rng = random.Random(seed)

    def route(self, request: RouteRequest, loads: Sequence[int],
              eligible: Sequence[int] | None = None) -> RoutingDecision:
        """One decision: the less loaded of two drawn (a lone eligible replica is chosen without a draw)."""
        candidates = candidates_of(self.num_replicas, eligible)
        if len(candidates) == 1:
            return RoutingDecision(candidates[0], self.name)
        return RoutingDecision(least_loaded(loads, self._rng.sample(candidates, 2)), self.name)


class PrefixAware:
    """The longest cached prefix, unless the loads are imbalanced (see the module's note)."""

    name = "prefix"

    def __init__(self, num_replicas: int, block_size: int, index_capacity: int,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, cache_threshold: float = CACHE_THRESHOLD) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if index_capacity < 1:
            raise ValueError(f"index_capacity must be >= 1 block, got {index_capacity}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance thresholds must be abs >= 0 and rel >= 1, got "
                             f"{balance_abs_threshold} and {balance_rel_threshold}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.index_capacity = index_capacity
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        # per replica: block hash -> None, least recently routed first (the router's view of its cache)
        self._index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """Beyond both thresholds: then the least loaded replica gets the request, whatever it holds."""
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of the leading hashes the replica's index holds."""
        index = self._index[replica]
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def route(self, request: RouteRequest, loads: Sequence[int],
              eligible: Sequence[int] | None = None) -> RoutingDecision:
        """One decision among `eligible` replicas (default: all); the prompt's blocks join the chosen one's index.

        Only the eligible replicas' loads take part, so a replica that is down neither attracts nor repels traffic."""
        return self.route_hashes(prompt_block_hashes(request, self.block_size), loads, eligible)

    def route_hashes(self, hashes: Sequence[int], loads: Sequence[int],
                     eligible: Sequence[int] | None = None) -> RoutingDecision:
        """`route` for a caller that has the prompt's block hashes already."""
        candidates = candidates_of(self.num_replicas, eligible)
        if self.imbalanced([loads[r] for r in candidates]):
            replica, reason = self._least_loaded(loads, candidates), "balance"
        else:
            matches = {r: self.matched_blocks(r, hashes) for r in candidates}
            best = max(matches.values())
            if best == 0 or best < self.cache_threshold * len(hashes):
                replica, reason = self._least_loaded(loads, candidates), "no_match" if best == 0 else "low_match"
            else:  # the longest match; ties: the less loaded, then the lower index
                replica = min((r for r in candidates if matches[r] == best), key=lambda r: loads[r])
                reason = "match"
        decision = RoutingDecision(replica, reason, self.matched_blocks(replica, hashes))
        self._remember(replica, hashes)
        return decision

    def _least_loaded(self, loads: Sequence[int], candidates: Sequence[int]) -> int:
        """The least loaded candidate; ties: the one whose index holds the fewest blocks, then the lower index."""
        return min(candidates, key=lambda r: (loads[r], len(self._index[r])))

    def _remember(self, replica: int, hashes: Sequence[int]) -> None:
        """The prompt's blocks are now (about to be) cached there; its head is touched last, so evicted last."""
        index = self._index[replica]
        for h in reversed(hashes):
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.index_capacity:
            index.popitem(last=False)


RouterPolicy = RoundRobin | LeastLoad | PowerOfTwo | PrefixAware


def make_router_policy(name: str, num_replicas: int, block_size: int, index_capacity: int, seed: int = 0,
                       balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                       balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                       cache_threshold: float = CACHE_THRESHOLD) -> RouterPolicy:
    """The named policy over `num_replicas` replicas (`block_size`, `index_capacity` and the thresholds are
    prefix's, `seed` power_of_two's); ValueError for an unknown name."""
    check_router_policy(name)
    if num_replicas < 1:
        raise ValueError(f"a fleet needs at least one replica, got {num_replicas}")
    if name == "round_robin":
        return RoundRobin(num_replicas)
    if name == "least_load":
        return LeastLoad(num_replicas)
    if name == "power_of_two":
        return PowerOfTwo(num_replicas, seed)
    return PrefixAware(num_replicas, block_size, index_capacity, balance_abs_threshold, balance_rel_threshold,
                       cache_threshold)
