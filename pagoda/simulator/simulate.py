"""Replay a crowd through the real engine, scheduler and block manager on virtual time.

Arrivals and hang-ups are events on a virtual clock; every forward advances
the clock by its modelled cost. A follow-up plan (`after`) arrives once the
client it follows has left, with that client's prompt and output before its
own. After the crowd has left, every client that completed is run again
alone (on the prompt it was sent), and its tokens must be identical.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

from pagoda.core.block_audit import AuditError
from pagoda.core.engine_config import EngineConfig
from pagoda.core.engine import Engine
from pagoda.core.request import FinishReason
from pagoda.core.scheduler import AdmissionError
from pagoda.simulator.clock import CostModel, TimedRunner, VirtualClock
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner


@dataclass(frozen=True)
class SimulationConfig:
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(num_blocks=64, block_size=16, max_running=16, max_batched_tokens=256, max_model_len=512)
    )
    vocab_size: int = 256
    model_seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    audit_every_step: bool = True
    max_steps: int = 1_000_000  # a livelock guard: a crowd that needs more steps is a bug


@dataclass
class ClientResult:
    client_id: str
    status: str = "pending"  # completed | hung_up | refused
    finish_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None  # simulated seconds from arrival to first token
    e2e: float | None = None  # simulated seconds from arrival to the end
    matches_solo: bool | None = None
    error: str | None = None
    steps_to_release: int | None = None  # hung-up clients: steps until their blocks were back
    tenant: str | None = None
    solo_ttft: float | None = None  # completed clients: the TTFT of its solo rerun (its TTFT alone)


@dataclass
class SimulationReport:
    clients: int
    completed: int
    hung_up: int
    refused: int
    peak_running: int
    preemptions: int
    recomputed_tokens: int
    aborted: int
    generated_tokens: int
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache (prompt + output on a resume)
    prefix_hit_tokens: int  # of which were found there and not computed
    draft_tokens: int  # n-gram drafts the greedy clients were given in padded rows (core/speculative.py)
    accepted_tokens: int  # of which kept
    steps: int
    solo_steps: int  # the solo reruns' steps, all together
    simulated_seconds: float
    pool: dict[str, int]
    audit: str
    matches_solo: bool
    wall_seconds: float
    wall_us_per_step: float  # wall time over every step taken (crowd pass and solo reruns), events and audits included
    max_steps_to_release: int
    # per tenant ("default" for None): {"clients", "completed", "ttft_p50", "ttft_alone_p50", "generated_tokens",
    # "share_while_active"}: its generated tokens over everyone's, in the steps it had a request in flight
    tenants: dict[str, dict]
    results: list[ClientResult]

    @property
    def ok(self) -> bool:
        return self.audit == "ok" and self.pool["free"] == self.pool["total"] and self.matches_solo

    def summary(self) -> dict:
        """The report without per-client results (the --json shape)."""
        out = asdict(self)
        out.pop("results")
        return out


def simulate(plans: list[ClientPlan], config: SimulationConfig | None = None, check_solo: bool = True) -> SimulationReport:
    """Run the crowd, then (optionally) every completed client alone; report what happened."""
    config = config or SimulationConfig()
    started = time.perf_counter()
    run = _CrowdRun(plans, config)
    audit = run.run()
    matches, solo_steps = check_against_solo(run.results.values(), run.sent_plan, config) if check_solo else (True, 0)
    wall = time.perf_counter() - started
    engine = run.engine
    stats = engine.stats()
    results = list(run.results.values())
    return SimulationReport(
        clients=len(plans),
        completed=sum(r.status == "completed" for r in results),
        hung_up=sum(r.status == "hung_up" for r in results),
        refused=sum(r.status == "refused" for r in results),
        peak_running=stats["peak_running"],
        preemptions=stats["preemptions_total"],
        recomputed_tokens=stats["recomputed_tokens_total"],
        aborted=stats["aborted_total"],
        generated_tokens=stats["generated_tokens_total"],
        prefix_queried_tokens=stats["prefix_cache_queried_tokens_total"],
        prefix_hit_tokens=stats["prefix_cache_hit_tokens_total"],
        draft_tokens=stats["spec_decode_draft_tokens_total"],
        accepted_tokens=stats["spec_decode_accepted_tokens_total"],
        steps=run.steps,
        solo_steps=solo_steps,
        simulated_seconds=round(run.clock.now, 6),
        pool={"total": stats["kv_blocks_total"], "free": stats["kv_blocks_free"]},
        audit=audit,
        matches_solo=matches,
        wall_seconds=round(wall, 3),
        wall_us_per_step=round(1e6 * wall / max(1, run.steps + solo_steps), 1),
        max_steps_to_release=max((r.steps_to_release or 0 for r in results), default=0),
        tenants=tenant_summary(results, run.activity),
        results=results,
    )


def check_against_solo(results: Iterable[ClientResult], sent_plan: Callable[[str], ClientPlan],
                       config: SimulationConfig) -> tuple[bool, int]:
    """Run every completed client alone on a fresh engine (the prompt it was sent, arriving at once, staying);
    sets each one's `matches_solo`. Returns whether all matched, and the solo runs' steps."""
    matches, solo_steps = True, 0
    for result in results:
        if result.status == "completed":
            solo = _CrowdRun([sent_plan(result.client_id).alone()], config)
            solo.run()
            solo_steps += solo.steps
            result.solo_ttft = solo.results[result.client_id].ttft
            result.matches_solo = solo.results[result.client_id].output_token_ids == result.output_token_ids
            matches = matches and result.matches_solo
    return matches, solo_steps


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return round(values[len(values) // 2], 6) if values else None


def tenant_summary(results: Iterable[ClientResult], activity: TenantActivity | None) -> dict[str, dict]:
    """Each tenant's clients, TTFT p50 (in the crowd and alone), generated tokens and share while active."""
    by_tenant: dict[str | None, list[ClientResult]] = {}
    for r in results:
        by_tenant.setdefault(r.tenant, []).append(r)
    out = {}
    for tenant, group in by_tenant.items():
        done = [r for r in group if r.status == "completed"]
        out["default" if tenant is None else tenant] = {
            "clients": len(group),
            "completed": len(done),
            "ttft_p50": _median([r.ttft for r in done if r.ttft is not None]),
            "ttft_alone_p50": _median([r.solo_ttft for r in done if r.solo_ttft is not None]),
            "generated_tokens": sum(len(r.output_token_ids) for r in group),
            "share_while_active": activity.share(tenant) if activity is not None else None,
        }
    return out


class TenantActivity:
    """Who had a request in flight (arrived, not yet left) in each step, and the tokens each step generated."""

    def __init__(self) -> None:
        self.in_flight: dict[str | None, int] = {}
        self.own: dict[str | None, int] = {}  # tokens a tenant generated in the steps it was active
        self.everyone: dict[str | None, int] = {}  # tokens every tenant generated in those steps

    def count_step(self, active: list[str | None], tokens: dict[str | None, int]) -> None:
        total = sum(tokens.values())
        for tenant in active:
            self.own[tenant] = self.own.get(tenant, 0) + tokens.get(tenant, 0)
            self.everyone[tenant] = self.everyone.get(tenant, 0) + total

    def active(self) -> list[str | None]:
        return [t for t, n in self.in_flight.items() if n > 0]

    def share(self, tenant: str | None) -> float | None:
        everyone = self.everyone.get(tenant, 0)
        return round(self.own.get(tenant, 0) / everyone, 4) if everyone else None


class _CrowdRun:
    """One pass of a crowd through a fresh engine."""

    def __init__(self, plans: list[ClientPlan], config: SimulationConfig) -> None:
        self.config = config
        self.plans = {p.client_id: p for p in plans}
        self.clock = VirtualClock()
        ec = config.engine
        runner = FakeModelRunner(ec.num_blocks, ec.block_size, config.vocab_size, seed=config.model_seed)
        self.engine = Engine(TimedRunner(runner, self.clock, config.cost), ec, eos_token_ids=(EOS_TOKEN_ID,),
                             clock=lambda: self.clock.now)
        self.results = {p.client_id: ClientResult(p.client_id, tenant=p.tenant) for p in plans}
        self.activity = TenantActivity()
        self.prompts: dict[str, list[int]] = {}  # the prompt each client that arrived was sent
        self.arrived_at: dict[str, float] = {}
        self.followers: dict[str, list[ClientPlan]] = {}
        # events: (time, order, kind, client_id); arrivals sort before hang-ups at the same instant
        self.events: list[tuple[float, int, str, str]] = []
        for p in plans:
            if p.after is None:
                self._expect(p, p.arrival)
            else:
                self.followers.setdefault(p.after, []).append(p)
        self.releasing: dict[str, int] = {}  # hung-up client -> steps since the hang-up
        self.steps = 0

    def _expect(self, plan: ClientPlan, at: float) -> None:
        heapq.heappush(self.events, (at, 0, "arrive", plan.client_id))
        if plan.hangup_after is not None:
            heapq.heappush(self.events, (at + plan.hangup_after, 1, "hangup", plan.client_id))

    def _left(self, client_id: str) -> None:
        """The client is gone (completed, failed, hung up or refused): its follow-ups set out."""
        tenant = self.plans[client_id].tenant
        self.activity.in_flight[tenant] -= 1
        for plan in self.followers.pop(client_id, []):
            self._expect(plan, self.clock.now + plan.arrival)

    def sent_plan(self, client_id: str) -> ClientPlan:
        """The plan as it was sent, carrying the whole prompt it arrived with (a follow-up's grew turn by turn)."""
        return replace(self.plans[client_id], prompt=tuple(self.prompts[client_id]), after=None)

    def run(self) -> str:
        """Drive events and steps until the crowd has left; returns "ok" or what the audit found."""
        try:
            while self.events or self.engine.has_unfinished():
                if not self.engine.has_unfinished():
                    self.clock.advance_to(self.events[0][0])
                self._fire_due_events()
                wait = self.engine.anticipation() if self.engine.has_unfinished() else 0.0
                if wait > 0:  # the policy waits for a request: the clock runs to the next event or by `wait`
                    self.clock.advance_to(min(self.clock.now + wait, self.events[0][0]) if self.events
                                          else self.clock.now + wait)
                    self._fire_due_events()
                if self.engine.has_unfinished():
                    self._step()
            self.engine.audit()
        except AuditError as exc:
            return str(exc)
        return "ok"

    def _fire_due_events(self) -> None:
        while self.events and self.events[0][0] <= self.clock.now:
            _, _, kind, client_id = heapq.heappop(self.events)
            result = self.results[client_id]
            if kind == "arrive":
                self._arrive(self.plans[client_id], result)
            elif result.status == "pending":  # a hang-up after the end changes nothing
                result.status = "hung_up"
                self.engine.abort(client_id)
                self.releasing[client_id] = 0
                self._left(client_id)

    def _arrive(self, plan: ClientPlan, result: ClientResult) -> None:
        prompt = plan.prompt_token_ids(self.config.vocab_size)
        if plan.after is not None:
            prompt = self.prompts[plan.after] + self.results[plan.after].output_token_ids + prompt
        self.prompts[plan.client_id] = prompt
        self.arrived_at[plan.client_id] = self.clock.now
        self.activity.in_flight[plan.tenant] = self.activity.in_flight.get(plan.tenant, 0) + 1
        try:
            self.engine.add_request(plan.client_id, prompt, plan.sampling_params(), arrival_time=self.clock.now,
                                    cache_salt=plan.cache_salt, tenant=plan.tenant, priority=plan.priority,
                                    weight=plan.weight)
        except AdmissionError as exc:
            result.status, result.error = "refused", str(exc)
            self._left(plan.client_id)

    def _step(self) -> None:
        self.steps += 1
        if self.steps > self.config.max_steps:
            raise RuntimeError(f"crowd did not drain in {self.config.max_steps} steps")
        active, tokens = self.activity.active(), {}
        for out in self.engine.step():
            result = self.results[out.request_id]
            if out.new_token_ids and result.status == "pending":
                tokens[result.tenant] = tokens.get(result.tenant, 0) + len(out.new_token_ids)
                result.output_token_ids += out.new_token_ids
                if result.ttft is None:
                    result.ttft = round(self.clock.now - self.arrived_at[out.request_id], 6)
            if out.finished and out.finish_reason is not FinishReason.ABORT:
                result.status = "completed" if out.finish_reason is not FinishReason.ERROR else "failed"
                result.finish_reason = out.finish_reason.value
                result.e2e = round(self.clock.now - self.arrived_at[out.request_id], 6)
                self._left(out.request_id)
        self.activity.count_step(active, tokens)
        for client_id in list(self.releasing):
            self.releasing[client_id] += 1
            if not self.engine.block_manager.block_table(client_id):
                self.results[client_id].steps_to_release = self.releasing.pop(client_id)
        if self.config.audit_every_step:
            self.engine.audit()
