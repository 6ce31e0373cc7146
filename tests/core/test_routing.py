"""The routing policies (core/routing.py), the ones both the simulator's fleet and the live router run: each
policy's choices, among all replicas and among the eligible ones, and the prefix index's hashes against the prefix
cache's."""

import subprocess
import sys

import pytest

from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import (POLICIES, PrefixAware, RouteRequest, RoutingDecision, make_router_policy,
                                 prompt_block_hashes)
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner


def test_the_routing_policies_import_no_torch():
    """A live router process runs them (tests/test_layout.py holds the whole router to it too)."""
    code = "import sys, pagoda.core.routing; print([m for m in ('torch', 'xgrammar') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_round_robin_least_load_and_power_of_two():
    req = RouteRequest([1, 2, 3])
    rr = make_router_policy("round_robin", 3, 4, 8)
    assert [rr.route(req, [9, 0, 0]).replica for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    least = make_router_policy("least_load", 3, 4, 8)
    assert least.route(req, [2, 1, 1]).replica == 1 and least.route(req, [0, 0, 0]).replica == 0
    draws = [make_router_policy("power_of_two", 4, 4, 8, seed=5).route(req, [3, 1, 2, 0]).replica for _ in range(2)]
    assert draws[0] == draws[1]  # seeded
    p2 = make_router_policy("power_of_two", 4, 4, 8, seed=1)
    chosen = {p2.route(req, [5, 4, 3, 0]).replica for _ in range(60)}
    assert chosen == {1, 2, 3}  # the less loaded of two: never the most loaded of all
    assert make_router_policy("power_of_two", 1, 4, 8).route(req, [7]).replica == 0
    with pytest.raises(ValueError, match="unknown router policy"):
        make_router_policy("random", 2, 4, 8)


def test_prefix_follows_the_longest_match_until_the_loads_are_imbalanced():
    router = make_router_policy("prefix", 3, 4, 64, balance_abs_threshold=4, balance_rel_threshold=1.5)
    system = list(range(1, 13))  # three blocks of 4
    first = router.route(RouteRequest(system + [50, 51]), [0, 0, 0])
    assert (first.replica, first.reason, first.matched_blocks) == (0, "no_match", 0)
    other = router.route(RouteRequest([99] * 8), [1, 0, 0])  # no match: the least loaded
    assert (other.replica, other.reason) == (1, "no_match")
    again = router.route(RouteRequest(system + [60]), [3, 1, 0])  # the warm replica, though busier
    assert (again.replica, again.reason, again.matched_blocks) == (0, "match", 3)
    assert router.route(RouteRequest(system[:8] + [7, 7, 7, 7]), [3, 3, 3]).matched_blocks == 2
    # imbalanced beyond both thresholds (9 - 2 > 4 and 9 > 1.5 * 2): the least loaded, whatever it holds
    balanced = router.route(RouteRequest(system), [9, 2, 3])
    assert (balanced.replica, balanced.reason, balanced.matched_blocks) == (1, "balance", 0)
    # replicas 0 and 1 now both hold the prompt: beyond one threshold only, the match still decides
    assert router.route(RouteRequest(system), [4, 4, 0]).replica == 0  # 4 > 1.5 * 0, but 4 - 0 <= 4
    assert router.route(RouteRequest(system), [15, 15, 10]).replica == 0  # 15 - 10 > 4, but 15 <= 1.5 * 10
    assert router.route(RouteRequest(system), [15, 14, 10]).replica == 1  # the less loaded of the two matches
    assert router.route(RouteRequest(system), [16, 15, 10]).reason == "balance"  # 16 - 10 > 4 and 16 > 15
    # a miss with the loads tied goes to the replica whose index holds the fewest blocks
    assert router.route(RouteRequest([42] * 8), [0, 0, 0]).replica == 2


def test_prefix_keys_on_the_caches_own_hashes_salt_and_tenant_included():
    prompt = list(range(1, 30))
    bs = 4
    config = EngineConfig(num_blocks=32, block_size=bs, max_running=4, max_batched_tokens=64, max_model_len=128)
    engine = Engine(FakeModelRunner(config.num_blocks, bs), config, eos_token_ids=(EOS_TOKEN_ID,))
    engine.add_request("a", prompt, SamplingParams(max_tokens=2), cache_salt="s", tenant="t")
    while engine.has_unfinished():
        engine.step()
    routed = prompt_block_hashes(RouteRequest(prompt, cache_salt="s", tenant="t"), bs)
    assert len(routed) == len(prompt) // bs and set(routed) <= set(engine.block_manager.cached_blocks)
    for keys in ({"cache_salt": "s"}, {"tenant": "t"}, {"cache_salt": "x", "tenant": "t"}):
        assert not set(prompt_block_hashes(RouteRequest(prompt, **keys), bs)) & set(routed)
    router = make_router_policy("prefix", 2, bs, 64)
    router.route(RouteRequest(prompt, tenant="t"), [0, 0])
    assert router.route(RouteRequest(prompt, tenant="u"), [0, 0]).reason == "no_match"  # tenants never match
    assert router.route(RouteRequest(prompt, tenant="t"), [0, 0]).reason == "match"


def test_the_prefix_index_forgets_least_recently_routed_prompts_tail_first():
    router = PrefixAware(1, 4, index_capacity=3)
    a, b = list(range(1, 13)), list(range(100, 108))
    router.route(RouteRequest(a), [0])
    router.route(RouteRequest(b), [0])  # 3 + 2 blocks in an index of 3: a's two last blocks go
    assert router.matched_blocks(0, prompt_block_hashes(RouteRequest(a), 4)) == 1
    assert router.matched_blocks(0, prompt_block_hashes(RouteRequest(b), 4)) == 2


def test_every_policy_chooses_among_the_eligible_replicas_only():
    """What the live router asks: replicas down or full are left out, and their loads take no part."""
    req = RouteRequest(list(range(1, 20)))
    for name in POLICIES:
        policy = make_router_policy(name, 5, 4, 64, seed=3)
        for round_ in range(60):
            eligible = [r for r in range(5) if (r + round_) % 3]
            decision = policy.route(req, [round_ * 7 % (r + 2) for r in range(5)], eligible)
            assert isinstance(decision, RoutingDecision) and decision.replica in eligible, (name, round_)
        with pytest.raises(ValueError, match="no replica is eligible"):
            policy.route(req, [0] * 5, [])


def test_round_robin_skips_what_is_not_eligible_and_goes_on_from_there():
    req = RouteRequest([1])
    rr = make_router_policy("round_robin", 3, 4, 8)
    assert [rr.route(req, [0, 0, 0]).replica for _ in range(2)] == [0, 1]
    assert rr.route(req, [0, 0, 0], eligible=[0, 1]).replica == 0  # replica 2's turn, but it is out
    assert rr.route(req, [0, 0, 0]).replica == 1  # and on from there
    assert [rr.route(req, [0, 0, 0], eligible=[1, 2]).replica for _ in range(3)] == [2, 1, 2]


def test_least_load_and_power_of_two_read_only_the_eligible_loads():
    req = RouteRequest([1])
    assert make_router_policy("least_load", 3, 4, 8).route(req, [0, 3, 1], eligible=[1, 2]).replica == 2
    p2 = make_router_policy("power_of_two", 3, 4, 8, seed=4)
    assert {p2.route(req, [0, 3, 1], eligible=[1, 2]).replica for _ in range(20)} == {2}  # the less loaded of 1, 2
    assert {p2.route(req, [0, 0, 0], eligible=[1]).replica for _ in range(5)} == {1}  # alone: no draw
