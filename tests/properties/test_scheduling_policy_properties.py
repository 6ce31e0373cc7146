"""Property tests: random tenant crowds under every scheduling policy, and the fair policy's share bound."""

from dataclasses import replace

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.request import Request
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduling import BUILTIN_POLICIES, FairPolicy
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.simulate import SimulationConfig, simulate
from tests.helpers import advance

POLICIES = sorted(BUILTIN_POLICIES)


@st.composite
def tenant_plans(draw, max_clients=16):
    n = draw(st.integers(1, max_clients))
    num_tenants = draw(st.integers(1, 4))
    weights = [draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for _ in range(num_tenants)]
    out = []
    for i in range(n):
        t = draw(st.integers(0, num_tenants - 1))
        sampled = draw(st.booleans())
        out.append(ClientPlan(
            client_id=f"c{i}", arrival=draw(st.floats(0, 0.3, allow_nan=False)), prompt_len=draw(st.integers(1, 30)),
            max_tokens=draw(st.integers(1, 16)), temperature=0.9 if sampled else 0.0,
            seed=draw(st.integers(0, 2**31 - 1)) if sampled else None,
            hangup_after=draw(st.none() | st.floats(0, 0.2, allow_nan=False)),
            tenant=f"t{t}", weight=weights[t], priority=draw(st.integers(0, 3)),
        ))
    return out


engine_configs = st.builds(
    EngineConfig, num_blocks=st.integers(12, 48), block_size=st.just(4), max_running=st.integers(1, 8),
    max_batched_tokens=st.integers(8, 64), max_model_len=st.just(64),
)


@pytest.mark.parametrize("policy", POLICIES)
@given(crowd=tenant_plans(), config=engine_configs)
def test_every_policy_keeps_the_ledger_and_solo_identical_answers(policy, crowd, config):
    report = simulate(crowd, SimulationConfig(engine=replace(config, scheduling_policy=policy)))
    note(str(report.summary()))
    assert report.audit == "ok"
    assert report.pool["free"] == report.pool["total"]
    assert report.matches_solo
    assert report.completed + report.hung_up + report.refused == len(crowd)


@given(
    counts=st.lists(st.integers(2, 30), min_size=2, max_size=4),
    weights=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=4, max_size=4),
    max_running=st.integers(2, 12),
    max_tokens=st.integers(1, 12),
    prompt_len=st.integers(1, 12),
)
def test_fair_never_leaves_a_backlogged_tenant_a_slot_short_of_its_weighted_share(
        counts, weights, max_running, max_tokens, prompt_len):
    """While every tenant is backlogged (has a request waiting after the step is scheduled), each tenant t runs
    at least R * w_t / W - 1 requests (R: max_running, W: the tenants' weights summed): at most one slot short.

    Why this bound: fair preempts for a waiting tenant t from the running tenant u with the most running / weight
    while (running_t + 1) / w_t < running_u / w_u, and admits the least loaded first. When it stops with every
    slot taken, running_u <= w_u * (running_t + 1) / w_t for every u; summed over u, R <= W * (running_t + 1) / w_t.
    It holds when only the slots limit admission, so the pool and the token budget here are ample; the ledger
    audit runs after every step."""
    tenants = [f"t{i}" for i in range(len(counts))]
    weight = dict(zip(tenants, weights))
    need = prompt_len + max_tokens
    config = EngineConfig(num_blocks=max_running * need + 8, block_size=1, max_running=max_running,
                          max_batched_tokens=max_running * need, max_model_len=need, speculative=None)
    scheduler = Scheduler(config, BlockManager(config.num_blocks, 1, True), policy=FairPolicy())
    arrival = 0
    for i in range(max(counts)):  # interleaved arrivals: every tenant's requests come in from the start
        for t, count in zip(tenants, counts):
            if i < count:
                prompt = [(arrival * 7 + j) % 200 + 1 for j in range(prompt_len)]
                scheduler.add(Request(f"{t}-{i}", prompt, SamplingParams(max_tokens=max_tokens),
                                      arrival_time=float(arrival), tenant=t, weight=weight[t]))
                arrival += 1
    total_weight = sum(weight.values())
    for _ in range(10_000):
        if not (scheduler.running or scheduler.waiting):
            break
        batch = scheduler.schedule()
        waiting = {r.tenant for r in scheduler.waiting}
        if waiting == set(tenants):
            running = {t: sum(r.tenant == t for r in scheduler.running) for t in tenants}
            note(f"running {running}, weights {weight}")
            for t in tenants:
                assert running[t] >= max_running * weight[t] / total_weight - 1 - 1e-9
        advance(scheduler, batch)
    assert not scheduler.running and not scheduler.waiting


@given(
    arrivals=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=40),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=3, max_size=3),
    max_running=st.integers(1, 6),
)
def test_fair_leaves_a_slot_empty_only_for_the_step_after_its_tenants_request_ended(arrivals, weights, max_running):
    """fair is work-conserving but for its anticipation: while requests wait, the slots it leaves empty are at most
    one for each tenant whose requests all ended in the step before (it ran then; nothing of it runs or waits
    now), and only while something else runs. Tenants come and go: (tenant, the step it arrives at, max_tokens)."""
    tenants = [f"t{i}" for i in range(3)]
    config = EngineConfig(num_blocks=6 * 16 + 8, block_size=1, max_running=max_running, max_batched_tokens=6 * 16,
                          max_model_len=16, speculative=None)
    scheduler = Scheduler(config, BlockManager(config.num_blocks, 1, True), policy=FairPolicy())
    by_step: dict[int, list[tuple[int, int]]] = {}
    for i, (t, at, max_tokens) in enumerate(arrivals):
        by_step.setdefault(at, []).append((i, t, max_tokens))
    ran: set[str] = set()
    for n in range(10_000):
        for i, t, max_tokens in by_step.pop(n, []):
            scheduler.add(Request(f"r{i}", [i % 200 + 1, 3, 5], SamplingParams(max_tokens=max_tokens),
                                  arrival_time=float(n), tenant=tenants[t], weight=weights[t]))
        if not (scheduler.running or scheduler.waiting or by_step):
            break
        present = {r.tenant for r in scheduler.running} | {r.tenant for r in scheduler.waiting}
        departed = ran - present
        batch = scheduler.schedule()
        empty = max_running - len(scheduler.running)
        if scheduler.waiting:
            note(f"step {n}: departed {departed}, running {len(scheduler.running)}, waiting {len(scheduler.waiting)}")
            assert empty <= (len(departed) if scheduler.running else 0)
        ran = {r.tenant for r in scheduler.running}
        advance(scheduler, batch)
    assert not scheduler.running and not scheduler.waiting
