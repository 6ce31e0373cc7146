"""`pagoda bench scheduler`: its rows per running-set size and the simulation's per-step cost."""

from __future__ import annotations

from pagoda.bench.scheduler import main, scheduler_step_cost, simulate_cost


def test_a_row_per_running_set_size(capsys):
    assert main(["--running", "4,8", "--steps", "5", "--clients", "0"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| schedule() + commit |")]
    assert [row.split("|")[2].strip() for row in rows] == ["4", "8"]
    assert all(len(row.split("|")) == 9 for row in rows)  # seven columns, CPU time beside the wall time


def test_step_cost_reports_wall_and_cpu_time():
    cost = scheduler_step_cost(num_running=8, steps=20)
    assert cost["running"] == 8 and cost["steps"] == 20
    assert 0 <= cost["p50_ms"] <= cost["p99_ms"] and cost["cpu_p50_ms"] >= 0


def test_the_simulation_counts_solo_steps_and_the_cost_per_step():
    sim = simulate_cost(clients=40)
    assert sim["solo_steps"] > 0 and sim["wall_us_per_step"] > 0
