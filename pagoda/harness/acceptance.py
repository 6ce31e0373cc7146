"""The acceptance crowd: one comparison instead of a checklist.

Run every plan alone on a live server, run them all together on the same
server, and require byte-identical answers from every client that stayed.
Concurrency is the only variable between the two passes. The crowd must also
prove it was hard: requests overlapped (peak running > 1, sampled from
/health while the crowd is in flight) and preemption happened (recomputed
positions > 0). Afterwards the pool is checked twice, because they are two
questions: the ledger audit (is it consistent?) and the counters (is it empty?).

A plan that follows another (`after`) is the next turn of its conversation: in
the crowd it starts `arrival` seconds after the client it follows finished and
sends that client's conversation, with the answer it got, before its own text;
a follow-up of a client that did not complete is skipped. The solo pass runs
the same chains one request at a time, each under a cache salt of its own, so
the baseline never reads the prefix cache while the crowd does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from typing import Any

import httpx

from pagoda.harness.crowd_client import ClientOutcome, Endpoints, check_protocols, run_client
from pagoda.core.engine_config import EngineConfig
from pagoda.simulator.clock import CostModel
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.report import SimulationReport
from pagoda.simulator.simulate import SimulationConfig, simulate


@dataclass
class CrowdReport:
    outcomes: dict[str, ClientOutcome]
    peak_active: int = 0  # clients in flight at once, counted by the harness
    peak_running: int = 0  # requests running in the engine, sampled from /health
    preemptions: int = 0
    recomputed_tokens: int = 0
    wall_seconds: float = 0.0
    health_samples: int = 0
    steps: int = 0  # engine steps the crowd took
    prefix_queried_tokens: int = 0  # prompt tokens the engine looked up in its prefix cache during the crowd
    prefix_hit_tokens: int = 0  # and found

    @property
    def seconds_per_step(self) -> float:
        return self.wall_seconds / max(1, self.steps)

    def summary(self) -> dict:
        statuses = [o.status for o in self.outcomes.values()]
        return {
            "clients": len(statuses),
            "completed": statuses.count("completed"),
            "hung_up": statuses.count("hung_up"),
            "failed": statuses.count("failed"),
            "skipped": statuses.count("skipped"),  # follow-ups of clients that did not complete
            "peak_active": self.peak_active,
            "peak_running": self.peak_running,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "wall_seconds": round(self.wall_seconds, 3),
            "steps": self.steps,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_queried_tokens": self.prefix_queried_tokens,
        }


@dataclass
class _Gauge:
    active: int = 0
    peak: int = 0
    samples: list[dict] = field(default_factory=list)


async def health(http: httpx.AsyncClient) -> dict:
    response = await http.get("/health")
    response.raise_for_status()
    return response.json()


async def run_solo(base_url: str, plans: list[ClientPlan], model: str, endpoints: Endpoints,
                   headers: dict | None = None) -> dict[str, ClientOutcome]:
    """Each plan alone, one at a time, never hanging up, under a cache salt no other request uses: the baseline.

    A follow-up is sent after the plan it follows (plans are in an order where it comes later), with its answer.
    """
    check_protocols(plans, endpoints)
    check_chains(plans)
    run = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        outcomes: dict[str, ClientOutcome] = {}
        for plan in plans:
            history = outcomes[plan.after].conversation if plan.after else ()
            outcomes[plan.client_id] = await run_client(http, plan.alone(), model, endpoints, headers, history=history,
                                                        cache_salt=f"solo-{run}-{plan.client_id}")
        return outcomes


async def run_crowd(
    base_url: str, plans: list[ClientPlan], model: str, endpoints: Endpoints, headers: dict | None = None,
    max_connections: int | None = None,
) -> CrowdReport:
    """All plans at once over one connection pool, each starting at its arrival time."""
    check_protocols(plans, endpoints)
    check_chains(plans)
    limits = httpx.Limits(max_connections=max_connections or len(plans) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        before = await health(http)
        gauge = _Gauge()
        started = time.perf_counter()
        sampler = asyncio.ensure_future(_sample_health(http, gauge))
        loop = asyncio.get_running_loop()
        left: dict[str, asyncio.Future[ClientOutcome]] = {plan.client_id: loop.create_future() for plan in plans}
        try:
            results = await asyncio.gather(*(_arrive(http, plan, model, endpoints, headers, gauge, left)
                                             for plan in plans))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        wall = time.perf_counter() - started
        after = await health(http)
    return CrowdReport(
        outcomes={o.client_id: o for o in results},
        peak_active=gauge.peak,
        peak_running=max((s["running"] for s in gauge.samples), default=0),
        preemptions=after["preemptions_total"] - before["preemptions_total"],
        recomputed_tokens=after["recomputed_tokens_total"] - before["recomputed_tokens_total"],
        wall_seconds=wall,
        health_samples=len(gauge.samples),
        steps=after["steps_total"] - before["steps_total"],
        prefix_queried_tokens=after["prefix_cache_queried_tokens_total"] - before["prefix_cache_queried_tokens_total"],
        prefix_hit_tokens=after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"],
    )


def check_chains(plans: list[ClientPlan]) -> None:
    """Every follow-up names a client planned before it (so a conversation's turns run in order)."""
    seen: set[str] = set()
    for plan in plans:
        if plan.after is not None and plan.after not in seen:
            raise ValueError(f"plan {plan.client_id} follows {plan.after!r}, which is not an earlier plan")
        seen.add(plan.client_id)


async def _arrive(http, plan: ClientPlan, model: str, endpoints: Endpoints, headers, gauge: _Gauge,
                  left: dict[str, asyncio.Future[ClientOutcome]]) -> ClientOutcome:
    outcome = None
    try:
        history: tuple[tuple[str, str], ...] = ()
        if plan.after is not None:
            previous = await left[plan.after]  # the turn before has ended (every client ends: bounded by timeouts)
            if previous.status != "completed":
                outcome = ClientOutcome(plan.client_id, status="skipped", error=f"{plan.after} {previous.status}")
                return outcome
            history = previous.conversation
        await asyncio.sleep(plan.arrival)  # the plan's arrival (or think) time is part of the workload, not a wait
        gauge.active += 1
        gauge.peak = max(gauge.peak, gauge.active)
        try:
            outcome = await run_client(http, plan, model, endpoints, headers, history=history)
        finally:
            gauge.active -= 1
        return outcome
    finally:
        left[plan.client_id].set_result(outcome or ClientOutcome(plan.client_id, status="failed"))


async def _sample_health(http: httpx.AsyncClient, gauge: _Gauge, every: float = 0.01) -> None:
    """Read /health (answered by the engine loop) for as long as the crowd is in flight."""
    while True:
        gauge.samples.append(await health(http))
        await asyncio.sleep(every)


# -- the checks ----------------------------------------------------------------
def check_answers(solo: dict[str, ClientOutcome], crowd: CrowdReport) -> int:
    """Every completed crowd answer is byte-identical to its solo answer; returns how many were compared."""
    mismatches = []
    compared = 0
    for client_id, outcome in crowd.outcomes.items():
        if outcome.status != "completed":
            continue
        alone = solo[client_id]
        compared += 1
        if (outcome.text, outcome.finish_reason) != (alone.text, alone.finish_reason):
            mismatches.append(f"{client_id}: crowd {outcome.text!r} ({outcome.finish_reason}) != solo {alone.text!r} ({alone.finish_reason})")
    if mismatches:
        raise AssertionError("answers differ between crowd and solo:\n" + "\n".join(mismatches))
    return compared


def check_survivors(plans: list[ClientPlan], crowd: CrowdReport) -> None:
    """Every client that did not hang up completed, with a finish reason its token count explains."""
    problems = []
    for plan in plans:
        outcome = crowd.outcomes[plan.client_id]
        if plan.hangup_after is not None:
            continue
        if outcome.status != "completed":
            problems.append(f"{plan.client_id}: {outcome.status} {outcome.error or ''}")
        elif outcome.finish_reason == "length" and outcome.output_tokens != plan.max_tokens:
            problems.append(f"{plan.client_id}: length after {outcome.output_tokens} of {plan.max_tokens} tokens")
        elif outcome.finish_reason not in ("stop", "length") or (outcome.output_tokens or 0) > plan.max_tokens:
            problems.append(f"{plan.client_id}: finish {outcome.finish_reason} with {outcome.output_tokens} tokens")
    if problems:
        raise AssertionError("survivors did not complete properly:\n" + "\n".join(problems))


async def check_pool_returned(base_url: str, audit: Callable[[], Awaitable[None]]) -> dict:
    """First the ledger audit (consistent?), then the counters (empty?): a running leftover passes one, not the other."""
    await audit()
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        stats = await health(http)
    if (stats["running"], stats["waiting"]) != (0, 0) or stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        raise AssertionError(f"the pool did not come back: {stats}")
    return stats


async def compare_solo_and_crowd(live: Any, plans: list[ClientPlan]) -> tuple[dict[str, ClientOutcome], CrowdReport, dict]:
    """The one comparison on a live server (`harness.live_server.LiveServer`): every plan alone, then all
    together, then the pool checked: (solo outcomes, the crowd's report, the final /health)."""
    solo = await run_solo(live.url, plans, live.model_name, live.endpoints)
    crowd = await run_crowd(live.url, plans, live.model_name, live.endpoints)
    await asyncio.wait_for(live.async_engine.wait_until_idle(), 60)
    stats = await check_pool_returned(live.url, live.async_engine.audit)
    return solo, crowd, stats


# -- the live run replayed in the simulator --------------------------------------
def as_simulated(plans: list[ClientPlan], solo: dict[str, ClientOutcome]) -> list[ClientPlan]:
    """The live crowd as the simulator's crowd: the same arrivals, lengths and hang-ups, token ids for text.

    The fake model has its own EOS, so the replay ignores it: the live clients that completed ran to a
    length the plan fixes (the check below compares only who completed).
    """
    return [
        dataclasses.replace(plan, prompt_text=None, prompt=None, prompt_len=solo[plan.client_id].prompt_tokens,
                            max_tokens=solo[plan.client_id].output_tokens or plan.max_tokens, ignore_eos=True)
        for plan in plans
    ]


def predict_in_simulator(plans: list[ClientPlan], solo: dict[str, ClientOutcome], engine: EngineConfig,
                         seconds_per_step: float) -> SimulationReport:
    """Replay the crowd with the live server's engine config and its measured seconds per step."""
    cost = CostModel(step_overhead_s=seconds_per_step, per_token_s=0.0, per_sequence_s=0.0)
    return simulate(as_simulated(plans, solo), SimulationConfig(engine=engine, cost=cost))


def check_prediction(prediction: SimulationReport, crowd: CrowdReport) -> None:
    """The simulator and the live run agree on which clients completed."""
    predicted = {r.client_id for r in prediction.results if r.status == "completed"}
    live = {cid for cid, o in crowd.outcomes.items() if o.status == "completed"}
    if predicted != live:
        raise AssertionError(f"simulator predicted completions {sorted(predicted)}, live run had {sorted(live)}")


# -- the crowds of the acceptance suite ------------------------------------------
