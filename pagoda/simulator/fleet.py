"""A fleet: N replicas of the real engine (each its own scheduler, ledger and prefix cache, on the fake model)
behind a simulated router, on one virtual clock.

Time. Each replica steps on its own: a step that starts at s costs c (the cost model, simulator/clock.py) and
its outputs reach the clients at s + c, when the replica starts its next step. As on the engine's own thread
(core/async_engine.py), a request or an abort that reaches a replica while its step is under way waits in the
replica's inbox and is applied between steps, after that step's outputs. The router decides at the arrival
instant, from each replica's requests sent and not yet answered (`_Replica.load`; the policies are
core/routing.py's). TTFT and e2e count from the client's arrival. At one instant the order is: step ends,
arrivals, hang-ups, step starts (arrivals and hang-ups by client id), so a fleet of one replica runs exactly
as `simulate()` does, step for step and token for token (tests/properties/test_fleet_properties.py); only its
TTFT also counts the wait for the step under way.

Every replica is audited after each of its steps; after the crowd has left, every completed client runs alone
on a fresh engine, as in `simulate()`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace

from pagoda.core import routing
from pagoda.core.block_audit import AuditError
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason
from pagoda.core.scheduler import AdmissionError
from pagoda.simulator.clock import TimedRunner, VirtualClock
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from pagoda.simulator.simulate import ClientResult, SimulationConfig, SimulationReport, check_against_solo, tenant_summary

# what happens at an instant, in this order (the second field of an event)
_STEP_END, _ARRIVE, _HANG_UP, _STEP_START = 0, 1, 2, 3


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
        if self.router not in routing.POLICIES:
            raise ValueError(f"unknown router policy {self.router!r}; choose one of {', '.join(routing.POLICIES)}")

    def abs_threshold(self, engine: EngineConfig) -> int:
        """prefix's absolute balance threshold for replicas of this engine configuration."""
        return engine.max_running if self.balance_abs_threshold is None else self.balance_abs_threshold


@dataclass(frozen=True)
class RouteRecord:
    """One routing decision as the fleet made it: the loads the router saw, and what it chose."""

    client_id: str
    replica: int
    reason: str
    loads: tuple[int, ...]


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
    started = time.perf_counter()
    run = _FleetRun(plans, config, fleet)
    run.run()
    matches, solo_steps = check_against_solo(run.results.values(), run.sent_plan, config) if check_solo else (True, 0)
    wall = time.perf_counter() - started
    stats = [r.engine.stats() for r in run.replicas]
    total = {key: sum(s[key] for s in stats) for key in stats[0]}
    results = list(run.results.values())
    done = [r for r in results if r.status == "completed"]
    return FleetReport(
        clients=len(plans),
        completed=len(done),
        hung_up=sum(r.status == "hung_up" for r in results),
        refused=sum(r.status == "refused" for r in results),
        peak_running=run.peak_running,
        preemptions=total["preemptions_total"],
        recomputed_tokens=total["recomputed_tokens_total"],
        aborted=total["aborted_total"],
        generated_tokens=total["generated_tokens_total"],
        prefix_queried_tokens=total["prefix_cache_queried_tokens_total"],
        prefix_hit_tokens=total["prefix_cache_hit_tokens_total"],
        draft_tokens=total["spec_decode_draft_tokens_total"],
        accepted_tokens=total["spec_decode_accepted_tokens_total"],
        steps=run.steps,
        solo_steps=solo_steps,
        simulated_seconds=round(run.now, 6),
        pool={"total": total["kv_blocks_total"], "free": total["kv_blocks_free"]},
        audit=run.audit(),
        matches_solo=matches,
        wall_seconds=round(wall, 3),
        wall_us_per_step=round(1e6 * wall / max(1, run.steps + solo_steps), 1),
        max_steps_to_release=max((r.steps_to_release or 0 for r in results), default=0),
        tenants=tenant_summary(results, None),  # a share while active is counted on one engine's steps only
        results=results,
        router=fleet.router,
        prefix_hit_rate=_rate(sum(run.cached_tokens.values()), sum(run.prompt_tokens.values())),
        ttft=percentiles(r.ttft for r in done),
        e2e=percentiles(r.e2e for r in done),
        routes=dict(sorted(Counter(d.reason for d in run.decisions).items())),
        replicas=[run.replica_report(r, s) for r, s in zip(run.replicas, stats)],
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


class _Replica:
    """One engine on the fake model with its own step timing, and the commands waiting for its step to end."""

    def __init__(self, index: int, config: SimulationConfig) -> None:
        self.index = index
        self.clock = VirtualClock()  # the replica's time: its step's end while one is under way
        ec = config.engine
        runner = FakeModelRunner(ec.num_blocks, ec.block_size, config.vocab_size, seed=config.model_seed)
        self.engine = Engine(TimedRunner(runner, self.clock, config.cost), ec, eos_token_ids=(EOS_TOKEN_ID,),
                             clock=lambda: self.clock.now)
        self.stepping = False  # a step has started and its outputs are not delivered yet
        self.step_queued = False  # a step start is in the event queue
        self.outputs: list[AnswerDelta] = []  # the step under way's, delivered at its end
        self.inbox: list[tuple[int, str]] = []  # (_ARRIVE or _HANG_UP, client id), applied at the step's end
        self.num_inbox_arrivals = 0
        self.num_finishing = 0  # requests the step under way finished, whose clients have not had the end yet
        self.batch_running = 0  # requests in its current step's batch (0 once idle)
        self.releasing: dict[str, int] = {}  # hung-up client -> steps since the hang-up was applied
        self.steps = 0
        self.audit = "ok"

    @property
    def load(self) -> int:
        """What the router sees, as a live one counts requests sent and not yet answered: running and waiting
        there, on their way in, and finished by the step under way but not yet delivered (the engine's
        queues already show the step's end)."""
        scheduler = self.engine.scheduler
        return scheduler.num_running + scheduler.num_waiting + self.num_inbox_arrivals + self.num_finishing


class _FleetRun:
    """One pass of a crowd through a fresh fleet."""

    def __init__(self, plans: list[ClientPlan], config: SimulationConfig, fleet: FleetConfig) -> None:
        self.config = config
        self.plans = {p.client_id: p for p in plans}
        self.replicas = [_Replica(i, config) for i in range(fleet.replicas)]
        ec = config.engine
        self.router = routing.make_router(
            fleet.router, fleet.replicas, ec.block_size, fleet.index_capacity or ec.num_blocks, fleet.seed,
            fleet.abs_threshold(ec), fleet.balance_rel_threshold, fleet.cache_threshold,
        )
        self.results = {p.client_id: ClientResult(p.client_id, tenant=p.tenant) for p in plans}
        self.prompts: dict[str, list[int]] = {}  # the prompt each client that arrived was sent
        self.arrived_at: dict[str, float] = {}
        self.replica_of: dict[str, int] = {}
        # clients that got a token: the prompt tokens they were sent, and of those found in the cache when first
        # scheduled (what their usage reports)
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.followers: dict[str, list[ClientPlan]] = {}
        self.decisions: list[RouteRecord] = []
        # events: (time, what, client id or replica index); see the order of the _STEP_END.. constants
        self.events: list[tuple[float, int, str | int]] = []
        for p in plans:
            if p.after is None:
                self._expect(p, p.arrival)
            else:
                self.followers.setdefault(p.after, []).append(p)
        self.now = 0.0
        self.steps = 0
        self.running = 0  # the sum of the replicas' batch_running
        self.peak_running = 0

    # -- the crowd's side ------------------------------------------------
    def _expect(self, plan: ClientPlan, at: float) -> None:
        heapq.heappush(self.events, (at, _ARRIVE, plan.client_id))
        if plan.hangup_after is not None:
            heapq.heappush(self.events, (at + plan.hangup_after, _HANG_UP, plan.client_id))

    def _left(self, client_id: str) -> None:
        """The client is gone (completed, failed, hung up or refused): its follow-ups set out."""
        for plan in self.followers.pop(client_id, []):
            self._expect(plan, self.now + plan.arrival)

    def sent_plan(self, client_id: str) -> ClientPlan:
        """The plan as it was sent, carrying the whole prompt it arrived with (a follow-up's grew turn by turn)."""
        return replace(self.plans[client_id], prompt=tuple(self.prompts[client_id]), after=None)

    # -- the loop ----------------------------------------------------------
    def run(self) -> None:
        """Drive events until the crowd has left; an audit failure stops the run (`audit()` says where)."""
        try:
            while self.events:
                at, what, key = heapq.heappop(self.events)
                self.now = at
                if what == _STEP_END:
                    self._step_end(self.replicas[key])
                elif what == _ARRIVE:
                    self._arrive(self.plans[key])
                elif what == _HANG_UP:
                    self._send(self.replicas[self.replica_of[key]], _HANG_UP, key)
                else:
                    self._step_start(self.replicas[key])
            for replica in self.replicas:
                self._audit(replica)
        except AuditError:
            return

    def audit(self) -> str:
        """"ok", or each failed replica's audit."""
        failed = [f"replica {r.index}: {r.audit}" for r in self.replicas if r.audit != "ok"]
        return "; ".join(failed) or "ok"

    def _arrive(self, plan: ClientPlan) -> None:
        client_id = plan.client_id
        prompt = plan.prompt_token_ids(self.config.vocab_size)
        if plan.after is not None:
            prompt = self.prompts[plan.after] + self.results[plan.after].output_token_ids + prompt
        self.prompts[client_id] = prompt
        self.arrived_at[client_id] = self.now
        loads = tuple(r.load for r in self.replicas)
        route = self.router.route(routing.RouteRequest(prompt, plan.cache_salt, plan.tenant), loads)
        self.decisions.append(RouteRecord(client_id, route.replica, route.reason, loads))
        self.replica_of[client_id] = route.replica
        self._send(self.replicas[route.replica], _ARRIVE, client_id)

    def _send(self, replica: _Replica, what: int, client_id: str) -> None:
        """A command reaches the replica: applied now, or at the end of its step under way."""
        if replica.stepping:
            replica.inbox.append((what, client_id))
            replica.num_inbox_arrivals += what == _ARRIVE
            return
        self._apply(replica, what, client_id)
        self._wake(replica)

    def _apply(self, replica: _Replica, what: int, client_id: str) -> None:
        result = self.results[client_id]
        if what == _ARRIVE:
            plan = self.plans[client_id]
            try:
                replica.engine.add_request(client_id, self.prompts[client_id], plan.sampling_params(),
                                           arrival_time=self.arrived_at[client_id], cache_salt=plan.cache_salt,
                                           tenant=plan.tenant, priority=plan.priority, weight=plan.weight)
            except AdmissionError as exc:
                result.status, result.error = "refused", str(exc)
                self._left(client_id)
        elif result.status == "pending":  # a hang-up after the end changes nothing
            result.status = "hung_up"
            replica.engine.abort(client_id)
            replica.releasing[client_id] = 0
            self._left(client_id)

    def _wake(self, replica: _Replica) -> None:
        """An idle replica with work starts a step now (after this instant's arrivals and hang-ups)."""
        if not replica.stepping and not replica.step_queued and replica.engine.has_unfinished():
            replica.step_queued = True
            heapq.heappush(self.events, (self.now, _STEP_START, replica.index))

    def _step_start(self, replica: _Replica) -> None:
        replica.step_queued = False
        self.steps += 1
        if self.steps > self.config.max_steps:
            raise RuntimeError(f"crowd did not drain in {self.config.max_steps} steps")
        replica.clock.now = self.now
        replica.outputs = replica.engine.step()
        replica.steps += 1
        finished = sum(1 for out in replica.outputs if out.finished and out.finish_reason is not FinishReason.ABORT)
        replica.num_finishing = finished
        self._count_running(replica, replica.engine.scheduler.num_running + finished)  # the batch as scheduled
        for client_id in list(replica.releasing):
            replica.releasing[client_id] += 1
            if not replica.engine.block_manager.block_table(client_id):
                self.results[client_id].steps_to_release = replica.releasing.pop(client_id)
        if self.config.audit_every_step:
            self._audit(replica)
        replica.stepping = True
        heapq.heappush(self.events, (replica.clock.now, _STEP_END, replica.index))

    def _step_end(self, replica: _Replica) -> None:
        """The step's outputs reach their clients; then the commands that came meanwhile, in order."""
        replica.stepping, replica.num_finishing = False, 0
        outputs, replica.outputs = replica.outputs, []
        for out in outputs:
            result = self.results[out.request_id]
            if out.new_token_ids and result.status == "pending":
                result.output_token_ids += out.new_token_ids
                if result.ttft is None:
                    result.ttft = round(self.now - self.arrived_at[out.request_id], 6)
                    self.prompt_tokens[out.request_id] = out.num_prompt_tokens
                    self.cached_tokens[out.request_id] = out.num_cached_tokens
            if out.finished and out.finish_reason is not FinishReason.ABORT:
                result.status = "completed" if out.finish_reason is not FinishReason.ERROR else "failed"
                result.finish_reason = out.finish_reason.value
                result.e2e = round(self.now - self.arrived_at[out.request_id], 6)
                self._left(out.request_id)
        inbox, replica.inbox, replica.num_inbox_arrivals = replica.inbox, [], 0
        for what, client_id in inbox:
            self._apply(replica, what, client_id)
        self._wake(replica)
        if not replica.step_queued:
            self._count_running(replica, 0)

    def _count_running(self, replica: _Replica, batch_running: int) -> None:
        self.running += batch_running - replica.batch_running
        replica.batch_running = batch_running
        self.peak_running = max(self.peak_running, self.running)

    def _audit(self, replica: _Replica) -> None:
        try:
            replica.engine.audit()
        except AuditError as exc:
            replica.audit = str(exc)
            raise

    # -- the report --------------------------------------------------------
    def replica_report(self, replica: _Replica, stats: dict[str, int]) -> ReplicaReport:
        ids = [c for c, r in self.replica_of.items() if r == replica.index]
        mine = [self.results[c] for c in ids]
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
            prefix_hit_rate=_rate(sum(self.cached_tokens.get(c, 0) for c in ids),
                                  sum(self.prompt_tokens.get(c, 0) for c in ids)),
            steps=replica.steps,
            pool={"total": stats["kv_blocks_total"], "free": stats["kv_blocks_free"]},
            audit=replica.audit,
        )
