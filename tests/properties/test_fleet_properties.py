"""Property tests: random crowds through a fleet of real engines behind each routing policy.

Every replica is audited after each of its steps (the fleet calls `Engine.audit()`); the properties here are
what a whole fleet leaves behind, what each policy's decisions keep to, and that a fleet of one is the
simulator's one engine. The balance bounds proven, with L the loads (running + waiting + on their way in)
the router saw at a decision, and P the most requests the fleet held at any decision:
- round_robin: the replicas' assignment counts differ by at most 1;
- least_load: the chosen replica holds min(L); so no replica ever holds (or runs) more than floor(P / N) + 1;
- power_of_two: the chosen replica is never the only one holding max(L);
- prefix: the chosen replica holds at most max(min(L) + abs, rel * min(L)) (abs, rel: core/routing.py's
  balance thresholds), and min(L) when L is imbalanced beyond both; so no replica ever holds (or runs) more
  than max(floor(P / N) + abs, rel * floor(P / N)) + 1.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, note
from hypothesis import strategies as st

from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, POLICIES
from pagoda.simulator.crowd import shared_prefix_crowd
from pagoda.simulator.fleet import FleetConfig, FleetReport, simulate_fleet
from pagoda.simulator.simulate import SimulationConfig, simulate
from tests.properties.test_crowd_properties import impossible, plans
from tests.properties.test_prefix_cache_properties import prefix_crowds

BLOCK_SIZE = 4

engine_configs = st.builds(
    EngineConfig,
    num_blocks=st.integers(4, 48),
    block_size=st.just(BLOCK_SIZE),
    max_running=st.integers(1, 8),
    max_batched_tokens=st.integers(8, 96),
    max_model_len=st.just(128),
)
fleets = st.builds(
    FleetConfig,
    replicas=st.integers(1, 4),
    router=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**16),
    # small thresholds too, so that prefix's balance fallback happens in crowds this size
    balance_abs_threshold=st.sampled_from([None, 0, 1, 2, BALANCE_ABS_THRESHOLD]),  # None: max_running
    balance_rel_threshold=st.sampled_from([1.0, BALANCE_REL_THRESHOLD, 3.0]),
)
crowds = plans(max_clients=20) | prefix_crowds()


def loads_bound(fleet: FleetConfig, config: EngineConfig, report: FleetReport) -> float | None:
    """The most requests any replica may ever hold under the policy (see the module's note); None: no bound."""
    n = fleet.replicas
    even = max((sum(d.loads) for d in report.decisions), default=0) // n
    if fleet.router == "least_load":
        return even + 1
    if fleet.router == "prefix":
        return max(even + fleet.abs_threshold(config), fleet.balance_rel_threshold * even) + 1
    return None


@given(crowd=crowds, fleet=fleets, config=engine_configs)
def test_no_policy_loses_a_request_or_a_block(crowd, fleet, config):
    report = simulate_fleet(crowd, fleet, SimulationConfig(engine=config))
    note(str(report.summary()))
    assert report.ok and report.audit == "ok" and report.matches_solo  # every replica audited after every step
    for replica in report.replicas:
        assert replica.audit == "ok" and replica.pool == {"total": config.num_blocks, "free": config.num_blocks}
    assert report.completed + report.hung_up + report.refused == len(crowd)
    if all(p.prompt is None and p.after is None for p in crowd):  # prompts of known length: refused iff impossible
        refused = {r.client_id for r in report.results if r.status == "refused"}
        assert refused == {p.client_id for p in crowd if impossible(p, config)}
    assert sum(r.routed for r in report.replicas) == len(report.decisions) == len(crowd)
    assert report.max_steps_to_release <= 1


@given(crowd=crowds, fleet=fleets, config=engine_configs)
def test_every_decision_keeps_its_policys_balance_bound(crowd, fleet, config):
    report = simulate_fleet(crowd, fleet, SimulationConfig(engine=config), check_solo=False)
    decisions = report.decisions
    counts = [r.routed for r in report.replicas]
    for d in decisions:
        chosen, lo, hi = d.loads[d.replica], min(d.loads), max(d.loads)
        if fleet.router == "least_load":
            assert chosen == lo
        elif fleet.router == "power_of_two" and fleet.replicas > 1:
            assert chosen < hi or d.loads.count(hi) > 1
        elif fleet.router == "prefix":
            assert chosen <= max(lo + fleet.abs_threshold(config), fleet.balance_rel_threshold * lo)
            if hi - lo > fleet.abs_threshold(config) and hi > fleet.balance_rel_threshold * lo:
                assert d.reason == "balance" and chosen == lo
    if fleet.router == "round_robin":
        assert max(counts) - min(counts) <= 1
    bound = loads_bound(fleet, config, report)
    if bound is not None:
        for i, replica in enumerate(report.replicas):
            held = max((d.loads[i] + 1 for d in decisions if d.replica == i), default=0)  # a load rises only here
            note(f"replica {i}: peak running {replica.peak_running}, held at most {held}, bound {bound}")
            assert replica.peak_running <= held <= bound


@given(crowd=crowds, router=st.sampled_from(POLICIES), config=engine_configs)
def test_a_fleet_of_one_runs_as_the_one_engine_simulator(crowd, router, config):
    """Step for step and token for token (one loop runs both: the TTFTs are equal, within the bound below too)."""
    sim = SimulationConfig(engine=config)
    one = simulate(crowd, sim, check_solo=False)
    fleet = simulate_fleet(crowd, FleetConfig(replicas=1, router=router), sim, check_solo=False)
    wall = {"wall_seconds": 0, "wall_us_per_step": 0, "tenants": {}}  # tenants: TTFTs differ (below), share is one engine's
    assert one.summary() | wall == {k: v for k, v in fleet.summary().items() if k in one.summary()} | wall
    cost = sim.cost
    longest_step = (cost.step_overhead_s + cost.per_token_s * config.max_batched_tokens
                    + cost.per_sequence_s * config.max_running)
    for a, b in zip(one.results, fleet.results, strict=True):
        assert (a.client_id, a.status, a.output_token_ids, a.finish_reason, a.steps_to_release) == (
            b.client_id, b.status, b.output_token_ids, b.finish_reason, b.steps_to_release)
        if a.ttft is not None:
            waited = b.ttft - a.ttft
            assert -1e-5 <= waited <= longest_step + 1e-5
            assert b.e2e is None or abs((b.e2e - a.e2e) - waited) <= 1e-5


@given(
    clients=st.integers(2, 24),
    system_len=st.integers(4, 40),
    seed=st.integers(0, 2**16),
    arrival_gap=st.sampled_from([0.25, 0.5, 2.0]),  # the crowd's own spacing (0.25) and longer
    tenants=st.integers(1, 3),
    replicas=st.integers(2, 4),
    config=engine_configs,
)
def test_prefix_never_hits_less_than_round_robin_on_a_shared_prefix_crowd(
    clients, system_len, seed, arrival_gap, tenants, replicas, config
):
    """Clients one after another (each arrives to an empty fleet), with pools that never evict.

    Why it holds: every client of a tenant sends the same system blocks, and nothing is evicted or computed
    twice at once, so a client misses exactly when its replica has never served its tenant. Round robin
    sends a tenant's clients to every replica its turn lands on, and each one misses once; prefix sends
    the tenant's first client to an idle replica and every later one back there (one miss per tenant), as
    the loads are all 0 and never imbalanced. The prompts, and so the denominators, are the same.
    Outside this regime it can fail, and hypothesis finds how (docs/distributed.md, "A fleet in the
    simulator"): a burst that the router sends to a replica before the prefix is computed there misses
    in the same step, and pools so small that running requests evict each other's prefixes punish
    concentrating a prompt's clients on its warm replica.
    """
    crowd = shared_prefix_crowd(seed, clients=clients, system_len=system_len, max_question_len=8,
                                arrival_gap=arrival_gap, tenants=tenants)
    enough = clients * -(-(system_len + 8 + 16) // BLOCK_SIZE)  # every client's blocks at once: nothing evicted
    sim = SimulationConfig(engine=replace(config, num_blocks=enough))
    rates = {}
    for router in ("round_robin", "prefix"):
        report = simulate_fleet(crowd, FleetConfig(replicas=replicas, router=router), sim, check_solo=False)
        note(f"{router}: {report.summary()}")
        assert report.ok and report.completed == clients
        assert all(sum(d.loads) == 0 for d in report.decisions)  # the regime: one client at a time
        rates[router] = report.prefix_hit_rate
    assert rates["prefix"] >= rates["round_robin"]
    # client i is tenant i % T's, sent by round robin to replica i % N: tenant 0's clients 0 and T land on two
    # replicas unless N divides T, and the second misses there
    if clients > tenants and system_len >= BLOCK_SIZE and tenants % replicas != 0:
        assert rates["prefix"] > rates["round_robin"]
