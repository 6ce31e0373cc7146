"""A fleet: N replicas of the real engine (each its own scheduler, ledger and prefix cache, on the fake model)
behind a simulated router, on one virtual clock.

The crowd runs through the simulator's one loop (simulator/simulate.py, `CrowdRun`: its note says how time
runs), with a router that decides at each arrival from the replicas' loads; the policies are core/routing.py's,
the ones the live router runs. A fleet of one replica is the one-engine simulator, step for step and token for
token (tests/properties/test_fleet_properties.py). This module configures the fleet and reports on it: the
router's view and each replica's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from pagoda.core import routing
from pagoda.core.engine_config import EngineConfig
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.report import SimulationReport
from pagoda.simulator.simulate import CrowdRun, RouteRecord, SimulationConfig, run_crowd


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 1
    router: str = "prefix"
    seed: int = 0  # power_of_two's draws
    # prefix's balance thresholds (core/routing.py); the absolute one by default a replica's max_running: a
    # warm replica may hold a full batch more than the idlest before the load decides
    balance_abs_threshold: int | None = None
    balance_rel_threshold: float = routing.BALANCE_REL_THRESHOLD
    cache_threshold: float = routing.CACHE_THRESHOLD  # prefix: the least share of blocks matched worth following
    index_capacity: int | None = None  # prefix: blocks per replica in the router's index; None = a replica's pool

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        routing.check_router_policy(self.router)

    def abs_threshold(self, engine: EngineConfig) -> int:
        """prefix's absolute balance threshold for replicas of this engine configuration."""
        return engine.max_running if self.balance_abs_threshold is None else self.balance_abs_threshold


@dataclass
class ReplicaReport:
    routed: int
    completed: int
    hung_up: int
    refused: int
    peak_running: int
    preemptions: int
    recomputed_tokens: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float  # as the fleet's, over the clients it served
    steps: int
    pool: dict[str, int]
    audit: str


@dataclass
class FleetReport(SimulationReport):
    """The simulation report summed over the fleet (`peak_running`: the most requests in the replicas' batches
    at once), plus the router's view and each replica's."""

    router: str
    # hit tokens / looked-up prompt tokens, whole fleet: over every client that got a token, the prompt tokens
    # found in the cache when its request was first scheduled (its usage's cached tokens) over its prompt tokens.
    # Not prefix_hit_tokens / prefix_queried_tokens, which count a preempted request's resume again (its
    # prompt and output, found again in its own blocks): a policy that overloads a replica would score there.
    prefix_hit_rate: float
    ttft: dict[str, float | None]  # p50/p90/p99 over completed clients, virtual seconds
    e2e: dict[str, float | None]
    routes: dict[str, int]  # decisions by reason
    replicas: list[ReplicaReport]
    decisions: list[RouteRecord]

    @property
    def ok(self) -> bool:
        return super().ok and all(r.audit == "ok" and r.pool["free"] == r.pool["total"] for r in self.replicas)

    def summary(self) -> dict:
        """The report without per-client results and decisions (the --json shape)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("results", "decisions")}
        out["replicas"] = [asdict(r) for r in self.replicas]
        return out


def simulate_fleet(plans: list[ClientPlan], fleet: FleetConfig | None = None, config: SimulationConfig | None = None,
                   check_solo: bool = True) -> FleetReport:
    """Run the crowd through the fleet, then (optionally) every completed client alone; report what happened."""
    fleet, config = fleet or FleetConfig(), config or SimulationConfig()
    ec = config.engine
    router = routing.make_router_policy(
        fleet.router, fleet.replicas, ec.block_size, fleet.index_capacity or ec.num_blocks, fleet.seed,
        fleet.abs_threshold(ec), fleet.balance_rel_threshold, fleet.cache_threshold,
    )
    run = run_crowd(plans, config, router, check_solo)
    failed = [f"replica {r.index}: {r.audit}" for r in run.replicas if r.audit != "ok"]
    # tenants: a share while active is counted on one engine's steps only
    common = run.report_fields(audit="; ".join(failed) or "ok", activity=None)
    done = [r for r in common["results"] if r.status == "completed"]
    return FleetReport(
        **common,
        router=fleet.router,
        prefix_hit_rate=_rate(sum(run.cached_tokens.values()), sum(run.prompt_tokens.values())),
        ttft=percentiles(r.ttft for r in done),
        e2e=percentiles(r.e2e for r in done),
        routes=dict(sorted(Counter(d.reason for d in run.decisions).items())),
        replicas=[replica_report(run, i) for i in range(len(run.replicas))],
        decisions=run.decisions,
    )


def percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    """p50/p90/p99 by nearest rank (each an observed value); None when there are none."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in (50, 90, 99)}


def _rate(hits: int, queried: int) -> float:
    return round(hits / queried, 4) if queried else 0.0


def replica_report(run: CrowdRun, index: int) -> ReplicaReport:
    """What replica `index` was sent and did, from its engine's counters and its clients' results."""
    replica, stats = run.replicas[index], run.replicas[index].engine.stats()
    ids = [c for c, r in run.replica_of.items() if r == index]
    mine = [run.results[c] for c in ids]
    return ReplicaReport(
        routed=len(mine),
        completed=sum(r.status == "completed" for r in mine),
        hung_up=sum(r.status == "hung_up" for r in mine),
        refused=sum(r.status == "refused" for r in mine),
        peak_running=stats["peak_running"],
        preemptions=stats["preemptions_total"],
        recomputed_tokens=stats["recomputed_tokens_total"],
        prefix_queried_tokens=stats["prefix_cache_queried_tokens_total"],
        prefix_hit_tokens=stats["prefix_cache_hit_tokens_total"],
        prefix_hit_rate=_rate(sum(run.cached_tokens.get(c, 0) for c in ids),
                              sum(run.prompt_tokens.get(c, 0) for c in ids)),
        steps=replica.steps,
        pool={"total": stats["kv_blocks_total"], "free": stats["kv_blocks_free"]},
        audit=replica.audit,
    )
