"""The policies, on replica states made by hand: each picks an available replica, by its rule."""

from __future__ import annotations

from collections import Counter

import pytest

from pagoda.core.routing import RouteRequest
from pagoda.router.policy import (POLICIES, LeastLoad, PowerOfTwo, Prefix, ReplicaState, RequestInfo, RoundRobin,
                                  make_policy)

REQUEST = RequestInfo("POST", "/v1/chat/completions", "chat", b"{}")


def states(*in_flight: int, down: tuple[int, ...] = (), bound: int = 4) -> list[ReplicaState]:
    return [ReplicaState(i, f"http://r{i}", i not in down, n, bound) for i, n in enumerate(in_flight)]


def test_round_robin_takes_turns_and_skips_what_is_unavailable():
    policy = RoundRobin()
    assert [policy.choose(states(0, 0, 0), REQUEST) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert [policy.choose(states(0, 0, 0, down=(0,)), REQUEST) for _ in range(4)] == [2, 1, 2, 1]
    policy = RoundRobin()
    assert policy.choose(states(0, 0, 0), REQUEST) == 0
    assert policy.choose(states(0, 4, 0, bound=4), REQUEST) == 2  # replica 1's turn, but it is full
    assert policy.choose(states(0, 0, 0), REQUEST) == 0  # and on from there


def test_least_load_takes_the_fewest_in_flight_ties_by_index():
    policy = LeastLoad()
    assert policy.choose(states(2, 1, 1), REQUEST) == 1
    assert policy.choose(states(0, 0), REQUEST) == 0
    assert policy.choose(states(0, 3, 1, down=(0,)), REQUEST) == 2
    assert policy.choose(states(4, 4, 3, bound=4), REQUEST) == 2


def test_power_of_two_is_seeded_picks_the_less_loaded_of_two_and_only_available_ones():
    replicas = states(3, 0, 2, 1)
    picks = [PowerOfTwo(seed=7).choose(replicas, REQUEST) for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same first draw
    policy = PowerOfTwo(seed=1)
    seen = Counter(policy.choose(replicas, REQUEST) for _ in range(400))
    assert 0 not in seen  # the most loaded never wins a draw of two
    assert seen[1] > seen[3] > seen[2]  # 1 wins every draw it is in, 3 every one but against 1
    assert {policy.choose(states(0, 0, 1, down=(0, 1)), REQUEST) for _ in range(20)} == {2}


@pytest.mark.parametrize("name", POLICIES)
def test_no_policy_picks_an_unavailable_replica(name):
    policy = make_policy(name, seed=3)
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

    def ask(policy: Prefix, replicas: list[ReplicaState], prompt: RouteRequest | None) -> int:
        return policy.choose(replicas, RequestInfo("POST", "/v1/chat/completions", "chat", b"{}", prompt))

    policy = make_policy("prefix", balance_abs_threshold=4)
    assert isinstance(policy, Prefix) and policy.reads_prompt
    assert ask(policy, at(1, 0, 0), shared) == 1  # no match: the least loaded (ties: the emptier index)
    assert ask(policy, at(0, 3, 0), shared) == 1  # the match, though it is busier
    assert ask(policy, at(0, 3, 0), other) == 0  # another prefix, no match: the least loaded
    assert ask(policy, at(0, 3, 0, down=(1,)), shared) == 2  # the match is down: the least loaded, emptier index
    assert ask(policy, at(0, 9, 5), shared) == 0  # 9 - 0 > 4 and 9 > 1.5 * 0: balance wins over the match
    assert ask(policy, at(0, 1, 0), None) == 0  # no prompt read: the least in flight
    assert policy.reasons == {"no_match": 3, "match": 1, "balance": 1}
    assert policy._index(at(0, 0, 0)).block_size == 4  # from the replicas' /health


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("random")
