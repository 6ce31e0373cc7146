"""The policies behind the router's seam, on replica states made by hand: each picks an available replica, by its
rule; and they are the simulator's own: on the same loads the router chooses what the simulated fleet chose."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import POLICIES, RouteRequest, make_router_policy
from pagoda.router.policy import BuiltinPolicy, ReplicaState, RequestInfo
from pagoda.simulator.crowd import shared_prefix_crowd, with_adapters
from pagoda.simulator.fleet import FleetConfig, simulate_fleet
from pagoda.simulator.simulate import SimulationConfig

REQUEST = RequestInfo("POST", "/v1/chat/completions", "chat", b"{}")


def states(*in_flight: int, down: tuple[int, ...] = (), bound: int = 4) -> list[ReplicaState]:
    return [ReplicaState(i, f"http://r{i}", i not in down, n, bound) for i, n in enumerate(in_flight)]


def test_round_robin_takes_turns_and_skips_what_is_unavailable():
    policy = BuiltinPolicy("round_robin")
    assert [policy.choose(states(0, 0, 0), REQUEST) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert [policy.choose(states(0, 0, 0, down=(0,)), REQUEST) for _ in range(4)] == [2, 1, 2, 1]
    policy = BuiltinPolicy("round_robin")
    assert policy.choose(states(0, 0, 0), REQUEST) == 0
    assert policy.choose(states(0, 4, 0, bound=4), REQUEST) == 2  # replica 1's turn, but it is full
    assert policy.choose(states(0, 0, 0), REQUEST) == 0  # and on from there


def test_least_load_takes_the_fewest_in_flight_ties_by_index():
    policy = BuiltinPolicy("least_load")
    assert policy.choose(states(2, 1, 1), REQUEST) == 1
    assert policy.choose(states(0, 0), REQUEST) == 0
    assert policy.choose(states(0, 3, 1, down=(0,)), REQUEST) == 2
    assert policy.choose(states(4, 4, 3, bound=4), REQUEST) == 2


def test_power_of_two_is_seeded_picks_the_less_loaded_of_two_and_only_available_ones():
    replicas = states(3, 0, 2, 1)
    picks = [BuiltinPolicy("power_of_two", seed=7).choose(replicas, REQUEST) for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same first draw
    policy = BuiltinPolicy("power_of_two", seed=1)
    seen = Counter(policy.choose(replicas, REQUEST) for _ in range(400))
    assert 0 not in seen  # the most loaded never wins a draw of two
    assert seen[1] > seen[3] > seen[2]  # 1 wins every draw it is in, 3 every one but against 1
    assert {policy.choose(states(0, 0, 1, down=(0, 1)), REQUEST) for _ in range(20)} == {2}


@pytest.mark.parametrize("name", POLICIES)
def test_no_policy_picks_an_unavailable_replica(name):
    policy = BuiltinPolicy(name, seed=3)
    for round_ in range(50):
        replicas = states(*(round_ * 7 % (i + 2) for i in range(5)), down=(round_ % 5,), bound=3)
        if any(r.available for r in replicas):
            assert replicas[policy.choose(replicas, REQUEST)].available


def test_prefix_follows_the_cached_prefix_skips_what_is_unavailable_and_balances():
    health = {"kv_block_size": 4, "kv_blocks_total": 64}
    shared = RouteRequest(list(range(40)))
    other = RouteRequest(list(range(100, 140)))

    def at(*in_flight: int, down: tuple[int, ...] = ()) -> list[ReplicaState]:
        return [ReplicaState(i, f"http://r{i}", i not in down, n, 64, health) for i, n in enumerate(in_flight)]

    def ask(policy: BuiltinPolicy, replicas: list[ReplicaState], prompt: RouteRequest | None) -> int:
        return policy.choose(replicas, RequestInfo("POST", "/v1/chat/completions", "chat", b"{}", prompt))

    policy = BuiltinPolicy("prefix", balance_abs_threshold=4)
    assert isinstance(policy, BuiltinPolicy) and policy.reads_prompt
    assert ask(policy, at(1, 0, 0), shared) == 1  # no match: the least loaded (ties: the emptier index)
    assert ask(policy, at(0, 3, 0), shared) == 1  # the match, though it is busier
    assert ask(policy, at(0, 3, 0), other) == 0  # another prefix, no match: the least loaded
    assert ask(policy, at(0, 3, 0, down=(1,)), shared) == 2  # the match is down: the least loaded, emptier index
    assert ask(policy, at(0, 9, 5), shared) == 0  # 9 - 0 > 4 and 9 > 1.5 * 0: balance wins over the match
    assert ask(policy, at(0, 1, 0), None) == 0  # no prompt read: the least in flight
    assert policy.reasons == {"no_match": 3, "match": 1, "balance": 1}
    assert policy._core_policy(at(0, 0, 0)).block_size == 4  # from the replicas' /health


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown router policy"):
        BuiltinPolicy("random")


@pytest.mark.parametrize("name", POLICIES)
def test_the_router_and_the_simulators_policy_choose_alike_on_the_same_loads(name):
    """The router's policy object and the simulator's, driven with the same requests and loads (some replicas down
    or full: the router's eligible ones), make the same choice every time."""
    rng = random.Random(name)
    router = BuiltinPolicy(name, seed=9, balance_abs_threshold=2)
    simulated = make_router_policy(name, 4, 4, 64, seed=9, balance_abs_threshold=2)
    health = {"kv_block_size": 4, "kv_blocks_total": 64}  # what the simulated one was made with
    heads = [list(range(1, 13)), list(range(1, 9)) + [50, 51, 52, 53], [7] * 12]
    asked = 0
    for _ in range(300):
        loads = [rng.randrange(7) for _ in range(4)]
        down = set(rng.sample(range(4), rng.randrange(3)))
        replicas = [ReplicaState(i, f"http://r{i}", i not in down, n, 5, health) for i, n in enumerate(loads)]
        eligible = [r.index for r in replicas if r.available]
        if not eligible:
            continue
        prompt = RouteRequest(rng.choice(heads) + [rng.randrange(1, 100) for _ in range(rng.randrange(6))],
                              tenant=rng.choice([None, "t"]), adapter=rng.choice([None, "x", "y"]))
        chosen = router.choose(replicas, RequestInfo("POST", "/v1/chat/completions", "chat", b"{}", prompt))
        assert chosen == simulated.route(prompt, loads, eligible).replica
        asked += 1
    assert asked > 200


@pytest.mark.parametrize("name", POLICIES)
def test_the_router_makes_every_decision_the_simulated_fleet_made(name):
    """Each decision of a simulated fleet, replayed through the router's policy with the prompt and the loads the
    fleet saw and the replicas' /health: the replica the fleet chose, for the reason it chose it."""
    # whole prompts, loads that vary, the base model and two LoRA adapters
    crowd = with_adapters(shared_prefix_crowd(2, clients=60, arrival_gap=0.004, tenants=2), ("x", "y"))
    engine = EngineConfig(num_blocks=64, block_size=16, max_running=4, max_batched_tokens=128, max_model_len=256)
    fleet = FleetConfig(replicas=3, router=name, seed=5, balance_abs_threshold=2)
    report = simulate_fleet(crowd, fleet, SimulationConfig(engine=engine), check_solo=False)
    assert len({d.loads for d in report.decisions}) > 10
    router = BuiltinPolicy(name, seed=5, balance_abs_threshold=2, balance_rel_threshold=fleet.balance_rel_threshold,
                           cache_threshold=fleet.cache_threshold)
    health = {"kv_block_size": engine.block_size, "kv_blocks_total": engine.num_blocks}
    plans = {p.client_id: p for p in crowd}
    for d in report.decisions:
        plan = plans[d.client_id]
        replicas = [ReplicaState(i, f"http://r{i}", True, n, 10**6, health) for i, n in enumerate(d.loads)]
        prompt = RouteRequest(plan.prompt, plan.cache_salt, plan.tenant, plan.adapter)
        assert router.choose(replicas, RequestInfo("POST", "/v1/chat/completions", "chat", b"{}", prompt)) == d.replica
    assert router.reasons == report.routes
