"""Replay a crowd through the real engine, scheduler and block manager on virtual time: on one engine, or on a
fleet of N behind a router (simulator/fleet.py). One loop runs both; a fleet of one is the one engine.

Time. Arrivals and hang-ups are events on a virtual clock. Each engine (a replica) steps on its own: a step that
starts at s costs c (the cost model, simulator/clock.py) and its outputs reach the clients at s + c, when the
replica may start its next step. As on the engine's own thread (core/async_engine.py), a request or an abort that
reaches a replica while a step is under way waits in the replica's inbox and is applied between steps, after that
step's outputs; the engine stamps the request's arrival then, as the live engine does. Before each step the
replica asks the scheduling policy for its anticipation (fair's wait for a tenant about to come back, as
AsyncEngine asks) and holds the step that long, unless a request or an abort reaches it first: then the step
starts at once. At one instant the order is: step ends, arrivals, hang-ups, step starts (arrivals and hang-ups by
client id). TTFT and e2e count from the client's arrival, so they include the wait for a step under way.

A follow-up plan (`after`) arrives once the client it follows has left, with that client's prompt and output
before its own. With a router (core/routing.py's policies, the ones the live router runs), each arrival is sent
to the replica it chooses at that instant, from each replica's requests sent and not yet answered
(`_Replica.load`); without one there is one replica.

Every replica loads the LoRA adapters its crowd names (`ClientPlan.adapter`, through `Engine.load_adapter`) before
the crowd arrives; the fake model answers each adapter unlike the base and the others, so a row computed with the
wrong adapter fails the solo comparison. Every replica is audited after each of its steps. After the crowd has left, every client that completed is run
again alone (on the prompt it was sent) on a fresh engine, and its tokens must be identical.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pagoda.core.block_audit import AuditError
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason
from pagoda.core.routing import RouteRequest, RouterPolicy
from pagoda.core.scheduler import AdmissionError
from pagoda.simulator.clock import CostModel, TimedRunner, VirtualClock
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from pagoda.simulator.report import ClientResult, SimulationReport, TenantActivity, tenant_summary

# what happens at an instant, in this order (the second field of an event)
_STEP_END, _ARRIVE, _HANG_UP, _STEP_START = 0, 1, 2, 3


@dataclass(frozen=True)
class SimulationConfig:
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(num_blocks=64, block_size=16, max_running=16, max_batched_tokens=256, max_model_len=512)
    )
    vocab_size: int = 256  # the fake model's; a crowd whose prompts hold larger token ids widens it (`fitting`)
    model_seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    audit_every_step: bool = True
    max_steps: int = 1_000_000  # a livelock guard: a crowd that needs more steps is a bug

    def fitting(self, plans: Iterable[ClientPlan]) -> SimulationConfig:
        """This configuration with a vocabulary that holds every token id the crowd's prompts hold (a crowd
        recorded from real traffic holds a real model's ids)."""
        largest = max((max(p.prompt) for p in plans if p.prompt), default=-1)
        return self if largest < self.vocab_size else replace(self, vocab_size=largest + 1)


@dataclass(frozen=True)
class RouteRecord:
    """One routing decision as the fleet made it: the loads the router saw, and what it chose."""

    client_id: str
    replica: int
    reason: str
    loads: tuple[int, ...]


def simulate(plans: list[ClientPlan], config: SimulationConfig | None = None, check_solo: bool = True) -> SimulationReport:
    """Run the crowd on one engine, then (optionally) every completed client alone; report what happened."""
    run = run_crowd(plans, config or SimulationConfig(), None, check_solo)
    return SimulationReport(**run.report_fields(audit=run.replicas[0].audit, activity=run.activity))


def run_crowd(plans: list[ClientPlan], config: SimulationConfig, router: RouterPolicy | None,
              check_solo: bool) -> CrowdRun:
    """One pass of the crowd (on one engine, or the router's replicas), then (optionally) every completed client
    alone, on a vocabulary that holds the crowd's token ids; the run, timed, with the solo reruns' verdict."""
    config = config.fitting(plans)
    started = time.perf_counter()
    run = CrowdRun(plans, config, router)
    run.run()
    if check_solo:
        run.matches_solo, run.solo_steps = check_against_solo(run.results.values(), run.sent_plan, config)
    run.wall_seconds = time.perf_counter() - started
    return run


def check_against_solo(results: Iterable[ClientResult], sent_plan: Callable[[str], ClientPlan],
                       config: SimulationConfig) -> tuple[bool, int]:
    """Run every completed client alone on a fresh engine (the prompt it was sent, arriving at once, staying);
    sets each one's `matches_solo`. Returns whether all matched, and the solo runs' steps."""
    matches, solo_steps = True, 0
    for result in results:
        if result.status == "completed":
            solo = CrowdRun([sent_plan(result.client_id).alone()], config)
            solo.run()
            solo_steps += solo.steps
            result.solo_ttft = solo.results[result.client_id].ttft
            result.matches_solo = solo.results[result.client_id].output_token_ids == result.output_token_ids
            matches = matches and result.matches_solo
    return matches, solo_steps


class _Replica:
    """One engine on the fake model with its own step timing, and the commands waiting for its step to end."""

    def __init__(self, index: int, config: SimulationConfig, adapters: Iterable[str] = ()) -> None:
        self.index = index
        self.clock = VirtualClock()  # the replica's time: its step's end while one is under way
        ec = config.engine
        self.runner = FakeModelRunner(ec.num_blocks, ec.block_size, config.vocab_size, seed=config.model_seed)
        self.engine = Engine(TimedRunner(self.runner, self.clock, config.cost), ec, eos_token_ids=(EOS_TOKEN_ID,),
                             clock=lambda: self.clock.now)
        for name in adapters:  # every replica serves every adapter the crowd names
            self.engine.load_adapter(name, f"simulated/{name}")
        self.stepping = False  # a step has started and its outputs are not delivered yet
        self.step_at: float | None = None  # when its next step starts, while one is in the event queue
        self.held = False  # its next step was held for the scheduling policy's anticipation (once a step)
        self.outputs: list[AnswerDelta] = []  # the step under way's, delivered at its end
        self.active: list[str | None] = []  # the tenants with a request in flight when the step under way started
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


class CrowdRun:
    """One pass of a crowd through fresh engines: one, or the router's replicas (see the module's note)."""

    def __init__(self, plans: list[ClientPlan], config: SimulationConfig, router: RouterPolicy | None = None) -> None:
        self.config = config
        self.plans = {p.client_id: p for p in plans}
        self.router = router
        adapters = sorted({p.adapter for p in plans if p.adapter is not None})
        self.replicas = [_Replica(i, config, adapters)
                         for i in range(router.num_replicas if router is not None else 1)]
        self.results = {p.client_id: ClientResult(p.client_id, tenant=p.tenant) for p in plans}
        self.activity = TenantActivity()
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
        self.events: list[tuple[float, int, Any]] = []
        for p in plans:
            if p.after is None:
                self._expect(p, p.arrival)
            else:
                self.followers.setdefault(p.after, []).append(p)
        self.now = 0.0
        self.steps = 0
        self.running = 0  # the sum of the replicas' batch_running
        self.peak_running = 0
        self.matches_solo, self.solo_steps, self.wall_seconds = True, 0, 0.0  # run_crowd's

    # -- the crowd's side ------------------------------------------------
    def _expect(self, plan: ClientPlan, at: float) -> None:
        heapq.heappush(self.events, (at, _ARRIVE, plan.client_id))
        if plan.hangup_after is not None:
            heapq.heappush(self.events, (at + plan.hangup_after, _HANG_UP, plan.client_id))

    def _left(self, client_id: str) -> None:
        """The client is gone (completed, failed, hung up or refused): its follow-ups set out."""
        self.activity.in_flight[self.plans[client_id].tenant] -= 1
        for plan in self.followers.pop(client_id, []):
            self._expect(plan, self.now + plan.arrival)

    def sent_plan(self, client_id: str) -> ClientPlan:
        """The plan as it was sent, carrying the whole prompt it arrived with (a follow-up's grew turn by turn)."""
        return replace(self.plans[client_id], prompt=tuple(self.prompts[client_id]), after=None)

    # -- the loop ----------------------------------------------------------
    def run(self) -> None:
        """Drive events until the crowd has left; an audit failure stops the run (each replica's `audit` says)."""
        try:
            while self.events:
                at, what, key = heapq.heappop(self.events)
                if what == _STEP_START and self.replicas[key].step_at != at:
                    continue  # a held step that a command started early: its time has gone
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

    def _arrive(self, plan: ClientPlan) -> None:
        client_id = plan.client_id
        prompt = plan.prompt_token_ids(self.config.vocab_size)
        if plan.after is not None:
            prompt = self.prompts[plan.after] + self.results[plan.after].output_token_ids + prompt
        self.prompts[client_id] = prompt
        self.arrived_at[client_id] = self.now
        self.activity.in_flight[plan.tenant] = self.activity.in_flight.get(plan.tenant, 0) + 1
        replica = 0
        if self.router is not None:
            loads = tuple(r.load for r in self.replicas)
            decision = self.router.route(RouteRequest(prompt, plan.cache_salt, plan.tenant, plan.adapter), loads)
            self.decisions.append(RouteRecord(client_id, decision.replica, decision.reason, loads))
            replica = decision.replica
        self.replica_of[client_id] = replica
        self._send(self.replicas[replica], _ARRIVE, client_id)

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
                                           arrival_time=self.now, cache_salt=plan.cache_salt, tenant=plan.tenant,
                                           priority=plan.priority, weight=plan.weight, adapter=plan.adapter)
            except AdmissionError as exc:
                result.status, result.error = "refused", str(exc)
                self._left(client_id)
        elif result.status == "pending":  # a hang-up after the end changes nothing
            result.status = "hung_up"
            replica.engine.abort(client_id)
            replica.releasing[client_id] = 0
            self._left(client_id)

    def _wake(self, replica: _Replica) -> None:
        """A replica with work and no step under way or queued starts one now (after this instant's arrivals and
        hang-ups); a command that reaches a replica holding its step for the policy's anticipation ends the hold."""
        if replica.stepping or not replica.engine.has_unfinished():
            return
        if replica.step_at is None or (replica.held and replica.step_at > self.now):
            self._queue_step(replica, self.now)

    def _queue_step(self, replica: _Replica, at: float) -> None:
        replica.step_at = at
        heapq.heappush(self.events, (at, _STEP_START, replica.index))

    def _step_start(self, replica: _Replica) -> None:
        replica.step_at = None
        if not replica.held and (wait := replica.engine.anticipation()) > 0:
            replica.held = True  # the policy expects a request within `wait`: hold the step that long, or until one
            self._queue_step(replica, self.now + wait)
            return
        replica.held = False
        self.steps += 1
        if self.steps > self.config.max_steps:
            raise RuntimeError(f"crowd did not drain in {self.config.max_steps} steps")
        replica.clock.now = self.now
        replica.active = self.activity.active()
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
        tokens: dict[str | None, int] = {}
        for out in outputs:
            result = self.results[out.request_id]
            if out.new_token_ids and result.status == "pending":
                tokens[result.tenant] = tokens.get(result.tenant, 0) + len(out.new_token_ids)
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
        self.activity.count_step(replica.active, tokens)
        inbox, replica.inbox, replica.num_inbox_arrivals = replica.inbox, [], 0
        for what, client_id in inbox:
            self._apply(replica, what, client_id)
        self._wake(replica)
        if replica.step_at is None:
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
    def report_fields(self, audit: str, activity: TenantActivity | None) -> dict[str, Any]:
        """The SimulationReport's fields, summed over the replicas (`peak_running`: the most requests in their
        batches at once), with `audit` as the report says it and the tenants' shares from `activity` (or none)."""
        stats = [r.engine.stats() for r in self.replicas]
        total = {key: sum(s[key] for s in stats) for key in stats[0]}
        results = list(self.results.values())
        wall = self.wall_seconds
        return {
            "clients": len(self.plans),
            "completed": sum(r.status == "completed" for r in results),
            "hung_up": sum(r.status == "hung_up" for r in results),
            "refused": sum(r.status == "refused" for r in results),
            "peak_running": self.peak_running,
            "preemptions": total["preemptions_total"],
            "recomputed_tokens": total["recomputed_tokens_total"],
            "aborted": total["aborted_total"],
            "generated_tokens": total["generated_tokens_total"],
            "prefix_queried_tokens": total["prefix_cache_queried_tokens_total"],
            "prefix_hit_tokens": total["prefix_cache_hit_tokens_total"],
            "draft_tokens": total["spec_decode_draft_tokens_total"],
            "accepted_tokens": total["spec_decode_accepted_tokens_total"],
            "adapter_steps": sum(r.runner.adapter_steps for r in self.replicas),
            "mixed_adapter_steps": sum(r.runner.mixed_adapter_steps for r in self.replicas),
            "peak_step_adapters": max(r.runner.peak_step_adapters for r in self.replicas),
            "steps": self.steps,
            "solo_steps": self.solo_steps,
            "simulated_seconds": round(self.now, 6),
            "pool": {"total": total["kv_blocks_total"], "free": total["kv_blocks_free"]},
            "audit": audit,
            "matches_solo": self.matches_solo,
            "wall_seconds": round(wall, 3),
            "wall_us_per_step": round(1e6 * wall / max(1, self.steps + self.solo_steps), 1),
            "max_steps_to_release": max((r.steps_to_release or 0 for r in results), default=0),
            "tenants": tenant_summary(results, activity),
            "results": results,
        }
