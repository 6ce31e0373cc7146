"""LoRA adapters in the simulator: a crowd's plans name adapters, the simulation loads them, the fake model answers
each unlike the base and the others, and a row computed with the wrong adapter (or on another adapter's KV) fails
the solo comparison."""

from __future__ import annotations

import json

import pytest

from pagoda.cli.main import main
from pagoda.core import block_hash
from pagoda.core.engine_config import EngineConfig
from pagoda.simulator.crowd import (
    ClientPlan,
    crowd_from_json,
    crowd_to_json,
    mixed_crowd,
    shared_prefix_crowd,
    with_adapters,
)
from pagoda.simulator.fake_model import FakeModelRunner
from pagoda.simulator.fleet import FleetConfig, simulate_fleet
from pagoda.simulator.simulate import SimulationConfig, simulate

ADAPTERS = ("x", "y", "z")


def config(max_loras: int = 2, **engine) -> SimulationConfig:
    return SimulationConfig(engine=EngineConfig(**{
        "num_blocks": 64, "block_size": 4, "max_running": 8, "max_batched_tokens": 64, "max_model_len": 128,
        "max_loras": max_loras, **engine}))


def crowd(seed: int = 4, clients: int = 24) -> list[ClientPlan]:
    """The base and three adapters in turn, arriving together, no hang-ups: every client completes."""
    return with_adapters(mixed_crowd(seed, clients=clients, hangup_fraction=0, max_prompt_len=24, max_tokens=12,
                                     arrival_window=0.05), ADAPTERS)


def test_a_crowd_of_the_base_and_three_adapters_under_max_loras_2_answers_as_each_alone():
    plans = crowd()
    assert {p.adapter for p in plans} == {None, *ADAPTERS}
    report = simulate(plans, config(max_loras=2))
    assert report.ok, report.summary()
    assert report.completed == len(plans) and all(r.matches_solo for r in report.results)
    # adapters mixed in steps (with the base and with each other), never more than two of them in one
    assert report.adapter_steps > 0 and report.mixed_adapter_steps > 0
    assert report.peak_step_adapters == 2


def test_max_loras_1_runs_one_adapter_at_a_time_beside_the_base():
    report = simulate(crowd(seed=5), config(max_loras=1))
    assert report.ok and report.peak_step_adapters == 1 and report.mixed_adapter_steps > 0


def test_each_adapter_answers_unlike_the_base_and_every_other():
    prompt = tuple(range(3, 15))
    plans = [ClientPlan(f"c-{a}", prompt=prompt, max_tokens=12, ignore_eos=True, adapter=a) for a in (None, *ADAPTERS)]
    report = simulate(plans, config(max_loras=3))
    assert report.ok
    answers = [tuple(r.output_token_ids) for r in report.results]
    assert len(set(answers)) == len(answers), answers
    assert report.prefix_hit_tokens == 0  # one prompt under four adapters: four caches, no hit between them


def test_a_row_computed_with_another_adapter_fails_the_solo_comparison(monkeypatch):
    """A step's adapters shifted by one chunk (a row gets its neighbour's adapter) whenever a step mixes them: the
    crowd's answers change, while each solo run (one request a step) is untouched; the comparison must fail."""
    real = FakeModelRunner.chunk_adapters

    def shifted(self, batch):
        names = real(self, batch)
        return names[1:] + names[:1] if len(set(names)) > 1 else names

    monkeypatch.setattr(FakeModelRunner, "chunk_adapters", shifted)
    report = simulate(crowd(), config(max_loras=2))
    assert report.audit == "ok" and report.pool["free"] == report.pool["total"]  # the ledger is not what broke
    assert not report.matches_solo and not report.ok
    assert any(r.matches_solo is False for r in report.results)


def test_kv_shared_across_adapters_fails_the_solo_comparison(monkeypatch):
    """A block hash that forgets the adapter lets a prompt under one adapter hit KV another adapter computed: the
    fake model reads it into its answer, and the comparison fails. With the adapter in the hash nothing is shared
    across adapters, and the same crowd matches."""
    plans = with_adapters(shared_prefix_crowd(6, clients=12, system_len=24, arrival_gap=0.05), ("x",))
    good = simulate(plans, config(max_loras=1))
    assert good.ok and good.prefix_hit_tokens > 0  # shared within each adapter (and within the base)
    real = block_hash.chain_seed
    monkeypatch.setattr(block_hash, "chain_seed", lambda salt, tenant, adapter=None: real(salt, tenant))
    bad = simulate(plans, config(max_loras=1))
    assert bad.audit == "ok" and not bad.matches_solo
    assert bad.prefix_hit_tokens > good.prefix_hit_tokens


def test_a_fleet_serves_every_adapter_on_every_replica():
    report = simulate_fleet(crowd(seed=6, clients=30), FleetConfig(replicas=2, router="prefix"), config(max_loras=2))
    assert report.ok, report.summary()
    assert report.completed == 30 and report.peak_step_adapters <= 2 and report.adapter_steps > 0


def test_the_adapter_field_of_a_plan_is_parsed_strictly():
    plans = crowd(clients=8)
    assert crowd_from_json(crowd_to_json(plans)) == plans
    assert crowd_from_json('[{"client_id": "a", "adapter": "x"}]')[0].adapter == "x"
    with pytest.raises(ValueError, match=r"crowd\[0\] \(client 'a'\): adapter: expected `str \| null`, got `int`"):
        crowd_from_json('[{"client_id": "a", "adapter": 3}]')
    with pytest.raises(ValueError, match=r"crowd\[0\] \(client 'a'\): adapter must be a LoRA adapter's name"):
        crowd_from_json('[{"client_id": "a", "adapter": ""}]')
    with pytest.raises(ValueError, match="unknown fields: \\['adaptor'\\]"):
        crowd_from_json('[{"client_id": "a", "adaptor": "x"}]')


def test_a_follow_up_goes_on_under_the_adapter_of_what_it_follows():
    plans = with_adapters([ClientPlan("a"), ClientPlan("b"), ClientPlan("a2", after="a"), ClientPlan("b2", after="b")],
                          ("x",))
    assert [p.adapter for p in plans] == [None, "x", None, "x"]


def test_cli_adapters_and_max_loras(tmp_path, capsys):
    assert main(["simulate", "--clients", "40", "--seed", "3", "--num-blocks", "64", "--adapters", "3",
                 "--max-loras", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["matches_solo"] and out["audit"] == "ok"
    assert out["mixed_adapter_steps"] > 0 and out["peak_step_adapters"] == 2
    path = tmp_path / "crowd.json"
    path.write_text(json.dumps([{"client_id": "a", "prompt": [5, 6, 7], "max_tokens": 4, "adapter": "mine"},
                                {"client_id": "b", "prompt": [5, 6, 7], "max_tokens": 4}]))
    assert main(["simulate", "--crowd", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 2 and out["matches_solo"] and out["adapter_steps"] > 0
    with pytest.raises(SystemExit, match="--adapters shapes a generated crowd"):
        main(["simulate", "--crowd", str(path), "--adapters", "2"])
    with pytest.raises(SystemExit, match="--max-loras must be >= 1"):
        main(["simulate", "--max-loras", "0"])
