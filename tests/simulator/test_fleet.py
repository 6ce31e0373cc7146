"""The fleet (simulator/fleet.py) and the routing policies it runs (core/routing.py): each policy's choices, the
router's hashes against the prefix cache's, the report, the command line, and a sabotaged ledger caught on
one replica of several."""

import json

import pytest

from pagoda.cli.main import main
from pagoda.cli.simulate import make_crowd
from pagoda.core import routing
from pagoda.core.block_manager import BlockManager
from pagoda.core.engine import Engine
from pagoda.core.engine_config import EngineConfig
from pagoda.core.routing import RouteRequest, make_router, prompt_block_hashes
from pagoda.core.sampling_params import SamplingParams
from pagoda.simulator.crowd import chat_crowd, mixed_crowd
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner
from pagoda.simulator.fleet import FleetConfig, percentiles, simulate_fleet
from pagoda.simulator.simulate import simulate
from tests.test_layout import test_the_bookkeeping_and_the_plugin_interface_import_no_torch as check_torch_free

WALL = {"wall_seconds": 0, "wall_us_per_step": 0}  # the fields that measure the machine, not the run


def test_the_routing_policies_import_no_torch():
    check_torch_free("core/routing.py")  # a live router process shares them


def test_round_robin_least_load_and_power_of_two():
    req = RouteRequest([1, 2, 3])
    rr = make_router("round_robin", 3, 4, 8)
    assert [rr.route(req, [9, 0, 0]).replica for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    least = make_router("least_load", 3, 4, 8)
    assert least.route(req, [2, 1, 1]).replica == 1 and least.route(req, [0, 0, 0]).replica == 0
    draws = [make_router("power_of_two", 4, 4, 8, seed=5).route(req, [3, 1, 2, 0]).replica for _ in range(2)]
    assert draws[0] == draws[1]  # seeded
    p2 = make_router("power_of_two", 4, 4, 8, seed=1)
    chosen = {p2.route(req, [5, 4, 3, 0]).replica for _ in range(60)}
    assert chosen == {1, 2, 3}  # the less loaded of two: never the most loaded of all
    assert make_router("power_of_two", 1, 4, 8).route(req, [7]).replica == 0
    with pytest.raises(ValueError, match="unknown router policy"):
        make_router("random", 2, 4, 8)
    with pytest.raises(ValueError, match="replicas"):
        FleetConfig(replicas=0)


def test_prefix_follows_the_longest_match_until_the_loads_are_imbalanced():
    router = make_router("prefix", 3, 4, 64, balance_abs_threshold=4, balance_rel_threshold=1.5)
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
    router = make_router("prefix", 2, bs, 64)
    router.route(RouteRequest(prompt, tenant="t"), [0, 0])
    assert router.route(RouteRequest(prompt, tenant="u"), [0, 0]).reason == "no_match"  # tenants never match
    assert router.route(RouteRequest(prompt, tenant="t"), [0, 0]).reason == "match"


def test_the_prefix_index_forgets_least_recently_routed_prompts_tail_first():
    router = routing.PrefixAware(1, 4, index_capacity=3)
    a, b = list(range(1, 13)), list(range(100, 108))
    router.route(RouteRequest(a), [0])
    router.route(RouteRequest(b), [0])  # 3 + 2 blocks in an index of 3: a's two last blocks go
    assert router.matched_blocks(0, prompt_block_hashes(RouteRequest(a), 4)) == 1
    assert router.matched_blocks(0, prompt_block_hashes(RouteRequest(b), 4)) == 2


def test_percentiles_by_nearest_rank():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([3.0, None, 1.0]) == {"p50": 1.0, "p90": 3.0, "p99": 3.0}


def test_a_fleet_is_deterministic_and_reports_each_replica():
    crowd = mixed_crowd(4, clients=60)
    a = simulate_fleet(crowd, FleetConfig(replicas=3, router="power_of_two", seed=2))
    b = simulate_fleet(crowd, FleetConfig(replicas=3, router="power_of_two", seed=2))
    assert a.ok and a.summary() | WALL == b.summary() | WALL
    assert [r.output_token_ids for r in a.results] == [r.output_token_ids for r in b.results]
    assert sum(r.routed for r in a.replicas) == 60 == len(a.decisions)
    assert sum(r.completed for r in a.replicas) == a.completed and a.pool["total"] == 3 * 64
    assert a.ttft["p50"] <= a.ttft["p90"] <= a.ttft["p99"] and a.e2e["p99"] >= a.ttft["p99"]


def test_prefix_routing_hits_more_than_the_load_policies_on_chats():
    crowd = chat_crowd(0, chats=60, turns=3, arrival_window=3.0)
    rates = {p: simulate_fleet(crowd, FleetConfig(replicas=4, router=p), check_solo=False).prefix_hit_rate
             for p in routing.POLICIES}
    assert rates["prefix"] > max(rates["round_robin"], rates["least_load"], rates["power_of_two"])


def test_a_ledger_bug_on_one_replica_of_several_is_caught(monkeypatch):
    """Sabotage the pool (a freed block stays in use): some replica's audit must fail, and the run with it."""
    real_free = BlockManager.free

    def leaky_free(self, request_id):
        table = list(self.block_table(request_id))
        returned = real_free(self, request_id)
        if len(table) > 1:
            self._free.append(table[-1])
        return returned

    monkeypatch.setattr(BlockManager, "free", leaky_free)
    report = simulate_fleet(mixed_crowd(7, clients=60), FleetConfig(replicas=3, router="least_load"))
    assert not report.ok and report.audit.startswith("replica ")
    assert any(r.audit != "ok" for r in report.replicas)


def test_cli_fleet_json_contract(capsys):
    code = main(["simulate", "--clients", "90", "--replicas", "3", "--router", "prefix", "--crowd-shape",
                 "shared-prefix", "--arrival-rate", "40", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["clients"] == out["completed"] == 90 and out["router"] == "prefix"
    for key in ("clients", "completed", "hung_up", "peak_running", "preemptions", "recomputed_tokens", "pool",
                "audit", "matches_solo", "wall_seconds", "prefix_hit_rate"):
        assert key in out
    assert 0 < out["prefix_hit_rate"] <= 1 and set(out["ttft"]) == set(out["e2e"]) == {"p50", "p90", "p99"}
    assert len(out["replicas"]) == 3
    for replica in out["replicas"]:
        assert {"completed", "peak_running", "preemptions", "prefix_hit_rate", "audit"} <= set(replica)
        assert replica["audit"] == "ok" and replica["pool"]["free"] == replica["pool"]["total"] == 64


def test_cli_one_replica_without_a_router_is_the_simulator_as_it_was(capsys):
    assert main(["simulate", "--clients", "40", "--seed", "3", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--clients", "40", "--seed", "3", "--replicas", "1", "--json"]) == 0
    explicit = json.loads(capsys.readouterr().out)
    from pagoda.simulator.simulate import SimulationConfig

    alone = simulate(mixed_crowd(3, 40, 0.25), SimulationConfig(model_seed=3)).summary()
    assert default | WALL == explicit | WALL == alone | WALL and "replicas" not in default


def test_cli_text_output_has_a_table_per_replica(capsys):
    assert main(["simulate", "--clients", "30", "--replicas", "2", "--router", "round_robin"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("replica  routed"):].splitlines()
    assert len(table) == 3 and table[1].split()[:2] == ["0", "15"] and table[2].split()[:2] == ["1", "15"]


def test_generated_shapes_have_the_asked_number_of_clients():
    for shape in ("mixed", "shared-prefix", "chat", "agent"):
        crowd = make_crowd(shape, 1, 31, 0.25, 10.0)
        assert len(crowd) == 31
        firsts = [p.arrival for p in crowd if p.after is None]
        assert max(firsts) <= len(firsts) / 10.0 + 1e-9


@pytest.mark.slow
def test_ten_thousand_clients_over_four_replicas_run(capsys):
    """The documented scale (docs/distributed.md times it): the run completes, audited, and matches solo."""
    code = main(["simulate", "--clients", "10000", "--replicas", "4", "--router", "prefix", "--crowd-shape", "chat",
                 "--arrival-rate", "50", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["completed"] == 10000 and out["matches_solo"]
    assert all(r["audit"] == "ok" for r in out["replicas"])
