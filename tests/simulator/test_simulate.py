import json
import subprocess
import sys

import pytest

from pagoda.cli.main import main
from pagoda.core.block_manager import BlockManager
from pagoda.simulator.crowd import (
    ClientPlan, agent_crowd, chat_crowd, crowd_from_json, crowd_to_json, mixed_crowd, shared_prefix_crowd,
)
from pagoda.simulator.simulate import SimulationConfig, simulate

WALL = {"wall_seconds": 0, "wall_us_per_step": 0}  # the fields that measure the machine, not the run


def test_crowd_json_round_trip_and_errors():
    crowd = mixed_crowd(3, clients=20, protocols=("chat", "messages"))
    assert crowd_from_json(crowd_to_json(crowd)) == crowd
    with pytest.raises(ValueError, match="unknown fields"):
        crowd_from_json('[{"client_id": "a", "prompt_lenght": 3}]')
    with pytest.raises(ValueError, match="unique"):
        crowd_from_json('[{"client_id": "a"}, {"client_id": "a"}]')
    with pytest.raises(ValueError, match="top_p"):
        ClientPlan("a", top_p=0)


def test_a_plans_protocol_is_any_endpoints_name_and_the_simulator_imports_no_plugin():
    crowd = mixed_crowd(4, clients=6, protocols=("chat", "ollama-chat", "a-plugins-own"))
    assert crowd_from_json(crowd_to_json(crowd)) == crowd  # resolved by the live harness, not here
    for bad in ("", 3):
        with pytest.raises(ValueError, match="protocol"):
            ClientPlan("a", protocol=bad)
    code = "import sys, pagoda.simulator.simulate, pagoda.simulator.crowd; print(sorted(m for m in sys.modules if m.startswith('pagoda.plugins')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_simulation_is_deterministic():
    crowd = mixed_crowd(5, clients=40)
    a, b = simulate(crowd), simulate(crowd)
    assert [r.output_token_ids for r in a.results] == [r.output_token_ids for r in b.results]
    assert a.summary() | WALL == b.summary() | WALL


def test_report_has_per_client_timings():
    report = simulate(mixed_crowd(1, clients=10, hangup_fraction=0))
    done = [r for r in report.results if r.status == "completed"]
    assert done and all(r.ttft is not None and r.e2e >= r.ttft > 0 for r in done)


def test_a_ledger_bug_is_caught(monkeypatch):
    """Sabotage the pool (a freed block stays in use): the simulator must notice."""
    real_free = BlockManager.free

    def leaky_free(self, request_id):
        table = list(self.block_table(request_id))
        returned = real_free(self, request_id)
        if len(table) > 1:  # hand the last block back twice: two owners later
            self._free.append(table[-1])
        return returned

    monkeypatch.setattr(BlockManager, "free", leaky_free)
    report = simulate(mixed_crowd(7, clients=60), check_solo=True)
    assert not report.ok


def test_a_shared_block_freed_while_in_use_is_caught(monkeypatch):
    """Sabotage sharing: a free that ignores the other holders hands a shared block back to the pool."""

    def careless_free(self, request_id):
        table = self._tables.pop(request_id, [])
        self._num_offered.pop(request_id, None)
        for block_id in table:
            if self._ref_counts[block_id]:
                self._ref_counts[block_id] = 0  # as if nobody else held it
                if self._hash_of[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None
        return len(table)

    assert SimulationConfig().engine.enable_prefix_caching and SimulationConfig().audit_every_step
    monkeypatch.setattr(BlockManager, "free", careless_free)
    report = simulate(shared_prefix_crowd(3, clients=20, arrival_gap=0.01), check_solo=False)
    assert not report.ok and "ref count 0" in report.audit


def test_follow_ups_extend_what_they_follow_and_replay_alone():
    for crowd in (chat_crowd(1), agent_crowd(2)):
        assert crowd_from_json(crowd_to_json(crowd)) == crowd
        report = simulate(crowd)
        assert report.ok and report.completed == len(crowd) and report.prefix_hit_tokens > 0
    with pytest.raises(ValueError, match="not an earlier client"):
        crowd_from_json('[{"client_id": "b", "after": "a"}, {"client_id": "a"}]')


def test_cli_json_contract(capsys):
    code = main(["simulate", "--clients", "200", "--seed", "7", "--num-blocks", "64", "--hangup-fraction", "0.25", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("clients", "completed", "hung_up", "peak_running", "preemptions", "recomputed_tokens", "pool", "audit", "matches_solo", "wall_seconds"):
        assert key in out
    assert out["preemptions"] > 0 and out["hung_up"] > 0 and out["audit"] == "ok" and out["matches_solo"]
    assert out["pool"]["free"] == out["pool"]["total"] == 64


def test_cli_replays_a_saved_crowd(tmp_path, capsys):
    path = tmp_path / "crowd.json"
    assert main(["simulate", "--clients", "30", "--seed", "2", "--save-crowd", str(path), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--crowd", str(path), "--seed", "2", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first | WALL == second | WALL


def test_cli_replays_a_crowd_that_holds_a_real_models_token_ids(tmp_path, capsys):
    """A crowd recorded from real traffic holds ids far past the fake model's 256: the vocabulary widens to hold
    them, and the crowd runs (and its follow-up, whose prompt holds the answer, too)."""
    path = tmp_path / "real.json"
    path.write_text(json.dumps([
        {"client_id": "r0", "prompt": [128000, 4747, 374, 264, 1296], "max_tokens": 6},
        {"client_id": "r1", "arrival": 0.01, "prompt": [128000, 4747, 374, 264, 2500, 9], "max_tokens": 5,
         "temperature": 0.8, "seed": 3},
        {"client_id": "r2", "after": "r0", "prompt": [128006, 882], "max_tokens": 4},
    ]))
    assert main(["simulate", "--crowd", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 3 and out["audit"] == "ok" and out["matches_solo"]
    report = simulate(crowd_from_json(path.read_text()))
    assert report.ok and report.generated_tokens == out["generated_tokens"]


@pytest.mark.parametrize(("crowd", "said"), [
    ('[{"client_id": "a", "prompt": [1, -3]}]', "crowd[0] (client 'a'): prompt: token id -3"),
    ('[{"client_id": "a", "prompt": [1, 9999999999]}]', "crowd[0] (client 'a'): prompt: token id 9999999999"),
    ('[{"client_id": "a", "prompt": [1, "x"]}]', "crowd[0] (client 'a'): prompt[1]: expected `int`, got `str`"),
    ('[{"client_id": "a"}, {"client_id": "b", "max_tokens": "9"}]', "crowd[1] (client 'b'): max_tokens: expected"),
    ('[{"client_id": "a", "prompt": []}]', "crowd[0] (client 'a'): prompt is empty"),
    ('[{"client_id": "a", "top_p": 0}]', "crowd[0] (client 'a'): top_p must be in"),
    ('[{"client_id": "a", "prompt_lenght": 3}]', "crowd[0] (client 'a') has unknown fields: ['prompt_lenght']"),
    ('[{"client_id": "a"}, {"client_id": "a"}]', "crowd[1] (client 'a'): client_id is crowd[0]'s too"),
    ('[{"client_id": "b", "after": "a"}]', "crowd[0] (client 'b'): after: it follows 'a'"),
    ('[{"prompt": [1]}]', "crowd[0] (client None): Object missing required field `client_id`"),
    ('[3]', "crowd[0] must be an object"),
    ('{"client_id": "a"}', "a crowd is a JSON list"),
    ('[{"client_id": ', "a crowd is JSON"),
])
def test_cli_refuses_a_bad_crowd_file_in_one_line_with_status_2(tmp_path, capsys, crowd, said):
    path = tmp_path / "crowd.json"
    path.write_text(crowd)
    assert main(["simulate", "--crowd", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagoda simulate: --crowd {path}: ") and said in err, err


def test_cli_refuses_a_missing_crowd_file_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "pagoda", "simulate", "--crowd", "/no/such/crowd.json"],
                          capture_output=True, text=True, check=False)
    said = "pagoda simulate: --crowd /no/such/crowd.json: [Errno 2] No such file or directory: '/no/such/crowd.json'"
    assert done.returncode == 2 and done.stdout == "" and done.stderr.splitlines() == [said]
