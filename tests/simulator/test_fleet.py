"""The fleet (simulator/fleet.py): the report, the command line, and a sabotaged ledger caught on one replica of
several. The routing policies it runs are tested in tests/core/test_routing.py."""

import json
from dataclasses import replace

import pytest

from pagoda.cli.main import main
from pagoda.cli.simulate import make_crowd
from pagoda.core import routing
from pagoda.core.block_manager import BlockManager
from pagoda.core.engine_config import EngineConfig
from pagoda.core.scheduling import FairPolicy
from pagoda.simulator.crowd import ClientPlan, chat_crowd, mixed_crowd, noisy_neighbour_crowd
from pagoda.simulator.fleet import FleetConfig, percentiles, simulate_fleet
from pagoda.simulator.simulate import SimulationConfig, simulate

WALL = {"wall_seconds": 0, "wall_us_per_step": 0}  # the fields that measure the machine, not the run


def test_a_fleet_needs_a_replica_and_a_known_policy():
    with pytest.raises(ValueError, match="replicas"):
        FleetConfig(replicas=0)
    with pytest.raises(ValueError, match="unknown router policy"):
        FleetConfig(replicas=2, router="random")


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


def twice(crowd: list[ClientPlan]) -> list[ClientPlan]:
    """Two copies of a crowd, x and y: a client's two copies arrive together and sort side by side, so round robin
    over two replicas that behave alike sends every x to replica 0 and every y to replica 1."""
    def copy(plan: ClientPlan, tag: str) -> ClientPlan:
        return replace(plan, client_id=f"{plan.client_id}-{tag}",
                       after=None if plan.after is None else f"{plan.after}-{tag}")

    return [copy(p, tag) for p in crowd for tag in ("x", "y")]


def test_a_fleet_holds_a_step_for_the_policys_anticipation_as_one_engine_does(monkeypatch):
    """fair waits before a step for a tenant about to come back (FairPolicy.anticipation_s). Each replica of a
    fleet must wait as the one engine does, as each live replica's AsyncEngine does: two copies of a crowd over
    two replicas run as the crowd does on one engine, step for step, to the same virtual instant."""
    engine = EngineConfig(num_blocks=256, block_size=16, max_running=2, max_batched_tokens=256, max_model_len=512,
                          scheduling_policy="fair")
    crowd = noisy_neighbour_crowd(0, streams=8, turns=4, neighbour_turns=4, pause=0.001)  # B comes back in 1 ms
    sim = SimulationConfig(engine=engine)
    one = simulate(crowd, sim, check_solo=False)
    fleet = simulate_fleet(twice(crowd), FleetConfig(replicas=2, router="round_robin"), sim, check_solo=False)
    assert fleet.ok and [d.replica for d in fleet.decisions] == [0, 1] * len(crowd)
    assert [r.steps for r in fleet.replicas] == [one.steps, one.steps]
    assert fleet.simulated_seconds == one.simulated_seconds and fleet.preemptions == 2 * one.preemptions
    copies = {r.client_id: r for r in fleet.results}
    for a in one.results:
        for tag in ("x", "y"):
            b = copies[f"{a.client_id}-{tag}"]
            assert (b.status, b.output_token_ids, b.ttft, b.e2e) == (a.status, a.output_token_ids, a.ttft, a.e2e)
    # and the crowd is one where the wait matters: without it the engine runs another schedule
    monkeypatch.setattr(FairPolicy, "anticipation_s", 0.0)
    unheld = simulate(crowd, sim, check_solo=False)
    assert (unheld.steps, unheld.simulated_seconds) != (one.steps, one.simulated_seconds)


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
    code = main(["simulate", "--clients", "90", "--replicas", "3", "--router-policy", "prefix", "--crowd-shape",
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


def test_cli_old_flag_names_still_work_and_say_once_each_what_to_use(capsys):
    new = ["simulate", "--clients", "20", "--seed", "1", "--replicas", "2", "--json"]
    assert main([*new, "--router-policy", "least_load", "--scheduling-policy", "priority"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert main([*new, "--router", "least_load", "--policy", "priority"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) | WALL == expected | WALL and expected["router"] == "least_load"
    lines = err.splitlines()
    assert len(lines) == 2 and "--router is deprecated" in lines[0] and "use --router-policy" in lines[0]
    assert "--policy is deprecated" in lines[1] and "use --scheduling-policy" in lines[1]


def test_cli_text_output_has_a_table_per_replica(capsys):
    assert main(["simulate", "--clients", "30", "--replicas", "2", "--router-policy", "round_robin"]) == 0
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
    code = main(["simulate", "--clients", "10000", "--replicas", "4", "--router-policy", "prefix", "--crowd-shape",
                 "chat", "--arrival-rate", "50", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["completed"] == 10000 and out["matches_solo"]
    assert all(r["audit"] == "ok" for r in out["replicas"])
