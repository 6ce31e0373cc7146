"""`pagoda bench serve` end to end on the tiny random model: real servers on ephemeral loopback ports."""

from __future__ import annotations

import importlib.util
import json
import shlex
import socket
import sys
from pathlib import Path

import httpx
import pytest

from pagoda.bench.serve.sweep import main
from pagoda.simulator.crowd import crowd_to_json, mixed_crowd
from tests.server_fixtures import TINY_ENGINE, TINY_NAME, start_server

QUICK = ["--no-progress", "--input-len", "8", "--output-len", "4", "--request-timeout", "60", "--deadline", "120"]


def run_bench(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert main([*QUICK, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def assert_ordered(summary: dict) -> None:
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        lat = summary[key]
        assert 0 <= lat["p50"] <= lat["p90"] <= lat["p99"], (key, lat)


@pytest.fixture(scope="module")
def second_server(tiny_model_dir: Path):
    live = start_server(tiny_model_dir, TINY_NAME + "-peer", **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def test_a_pagoda_started_by_the_bench_over_two_concurrency_levels(tiny_model_dir: Path, tmp_path: Path, capsys):
    result = run_bench(tmp_path, "--model", str(tiny_model_dir), "--num-blocks", "64", "--max-running", "8",
                       "--server-arg=--dtype=float32", "--concurrency", "1,2", "--num-requests", "4",
                       "--slo-ttft-ms", "60000", "--plot-dir", str(tmp_path / "plots"))
    records = result["records"]
    assert sorted((r["level"], r["index"]) for r in records) == [(lv, i) for lv in (1, 2) for i in range(4)]
    for r in records:
        assert r["ok"] and r["error"] is None, r
        assert r["output_tokens"] == 4 and r["prompt_tokens"] > 0
        assert 0 < r["ttft"] <= r["e2e"] and len(r["itl"]) <= 3
        assert r["tpot"] is not None and r["tpot"] >= 0
    assert [s["level"] for s in result["summaries"]] == [1, 2]
    for s in result["summaries"]:
        assert (s["requests"], s["ok"], s["failed"], s["deadline_hit"]) == (4, 4, 0, False)
        assert_ordered(s)
        assert s["req_per_s"] > 0 and s["out_tok_per_s"] > 0
        assert s["goodput_req_per_s"] == pytest.approx(s["req_per_s"])  # a one-minute SLO: everyone meets it
        split = s["server_split_ms"]  # the started server is a pagoda: its own queue/prefill/decode split
        assert split is not None and all(split[k] is not None and split[k] >= 0 for k in ("queue", "prefill", "decode"))
    out = capsys.readouterr().out
    assert "| concurrency | ok | req/s |" in out and "| 2 | 4/4 |" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "plots: skipped" in out
    else:
        assert {p.name for p in (tmp_path / "plots").iterdir()} == {"throughput.png", "ttft_cdf.png", "itl_cdf.png"}


def test_the_chat_workload_reports_ttft_per_turn(tiny_server, tmp_path: Path, capsys):
    result = run_bench(tmp_path, "--url", tiny_server.url, "--workload", "chat", "--conversations", "2",
                       "--turns", "2", "--system-tokens", "40", "--user-tokens", "4")
    records = result["records"]
    assert sorted((r["conversation"], r["turn"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["ok"] for r in records)
    # Turn 1 resends turn 0's system prompt, question and answer: a longer prompt.
    by = {(r["conversation"], r["turn"]): r for r in records}
    assert all(by[c, 1]["prompt_tokens"] > by[c, 0]["prompt_tokens"] + 4 for c in (0, 1))
    (summary,) = result["summaries"]
    assert (summary["kind"], summary["level"]) == ("conversations", 2)
    assert set(summary["ttft_by_turn_ms"]) == {"0", "1"}
    assert all(lat["n"] == 2 for lat in summary["ttft_by_turn_ms"].values())
    out = capsys.readouterr().out
    assert "| server | turn | prompt tokens | TTFT p50 ms | TTFT p99 ms |" in out


def test_a_peer_gets_the_same_load_and_the_table_gives_ratios(tiny_server, second_server, tmp_path: Path, capsys):
    result = run_bench(tmp_path, "--url", tiny_server.url, "--peer-url", second_server.url, "--concurrency", "2",
                       "--num-requests", "4", "--endpoint", "chat")
    assert sorted({(s["server"], s["level"]) for s in result["summaries"]}) == [("pagoda", 2), ("peer", 2)]
    assert sum(r["server"] == "peer" and r["ok"] for r in result["records"]) == 4
    (ratio,) = result["ratios"]
    assert ratio["level"] == 2 and all(ratio[k] is not None and ratio[k] > 0 for k in ("req/s", "TTFT p50 ms"))
    by = {s["server"]: s for s in result["summaries"]}
    assert ratio["out tok/s"] == pytest.approx(by["pagoda"]["out_tok_per_s"] / by["peer"]["out_tok_per_s"])
    out = capsys.readouterr().out
    assert "| 2 | pagoda / peer |" in out and "x |" in out


def test_open_loop_poisson_arrivals(tiny_server, tmp_path: Path):
    result = run_bench(tmp_path, "--url", tiny_server.url, "--request-rate", "50", "--num-requests", "4",
                       "--workload", "paragraphs")
    (summary,) = result["summaries"]
    assert (summary["kind"], summary["level"], summary["ok"]) == ("rate", 50, 4)
    starts = sorted(r["start"] for r in result["records"])
    assert starts[0] < starts[-1]  # arrivals spread out, not all at once


def test_a_crowd_file_workload(tiny_server, tmp_path: Path):
    crowd = tmp_path / "crowd.json"
    crowd.write_text(crowd_to_json(mixed_crowd(seed=5, clients=3, max_prompt_len=8, max_tokens=5)))
    result = run_bench(tmp_path, "--url", tiny_server.url, "--workload", "crowd", "--crowd", str(crowd),
                       "--concurrency", "3", "--num-requests", "3")
    lengths = sorted(p.max_tokens for p in mixed_crowd(seed=5, clients=3, max_prompt_len=8, max_tokens=5))
    assert sorted(r["output_tokens"] for r in result["records"]) == lengths  # each plan's own output length


def test_a_crowd_workload_without_its_file_is_refused():
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "crowd", "--url", "http://127.0.0.1:9"])
    assert exc.value.code == 2


def _free_port() -> int:
    with socket.socket() as s:  # an ephemeral port the peer will listen on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_peer_command_is_started_waited_for_and_loaded(tiny_server, tiny_model_dir: Path, tmp_path: Path):
    port = _free_port()
    command = shlex.join([sys.executable, "-m", "pagoda", "serve", "--host", "127.0.0.1", "--port", str(port),
                          "--model", str(tiny_model_dir), "--dtype", "float32", "--num-blocks", "64",
                          "--max-running", "8", "--log-level", "warning"])
    result = run_bench(tmp_path, "--url", tiny_server.url, "--peer-url", f"http://127.0.0.1:{port}",
                       "--peer-command", command, "--concurrency", "2", "--num-requests", "2")
    assert sum(r["server"] == "peer" and r["ok"] for r in result["records"]) == 2
    with pytest.raises(httpx.TransportError):  # the bench stopped the peer it started
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)


def test_a_peer_command_that_exits_is_reported(tiny_server, capsys):
    command = shlex.join([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    code = main([*QUICK, "--url", tiny_server.url, "--peer-url", f"http://127.0.0.1:{_free_port()}",
                 "--peer-command", command])
    assert code == 2
    err = capsys.readouterr().err
    assert "exited (3) before it was ready" in err and "no model here" in err


def test_a_peer_command_needs_the_peer_url():
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--peer-command", "true"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_the_transformers_baseline_runs_the_same_prompts_one_at_a_time(tiny_server, tiny_model_dir: Path,
                                                                         tmp_path: Path, capsys):
    result = run_bench(tmp_path, "--url", tiny_server.url, "--model", str(tiny_model_dir), "--workload", "paragraphs",
                       "--concurrency", "2", "--num-requests", "2", "--transformers")
    baseline = result["baseline"]
    assert (baseline["requests"], baseline["output_tokens"]) == (16, 16 * 4)  # 16 topics, 4 tokens forced
    assert baseline["out_tok_per_s"] > 0
    out = capsys.readouterr().out
    assert "transformers generate, one at a time" in out and "| 2 | pagoda |" in out


def test_each_concurrency_level_can_send_its_own_number_of_requests(tiny_server, tmp_path: Path):
    result = run_bench(tmp_path, "--url", tiny_server.url, "--concurrency", "1,3", "--num-requests-per-level", "2,3")
    assert sorted((r["level"], r["index"]) for r in result["records"]) == [(1, 0), (1, 1), (3, 0), (3, 1), (3, 2)]
    with pytest.raises(SystemExit):
        main(["--url", tiny_server.url, "--concurrency", "1,3", "--num-requests-per-level", "2"])


def test_the_offline_baseline_runs_the_same_load_interleaved_and_gives_ratios(tiny_model_dir: Path, tmp_path: Path,
                                                                               capsys):
    result = run_bench(tmp_path, "--model", str(tiny_model_dir), "--num-blocks", "64", "--max-running", "8",
                       "--concurrency", "1,2", "--num-requests", "4", "--offline-baseline", "--offline-rounds", "2")
    by_server = {}
    for r in result["records"]:
        assert r["ok"] and r["error"] is None and r["output_tokens"] == 4 and r["prompt_tokens"] > 0, r
        assert 0 < r["ttft"] <= r["e2e"]
        by_server.setdefault(r["server"], []).append((r["level"], r["index"]))
    expected = [(lv, i) for lv in (1, 2) for i in range(4)]  # every request once, across the rounds
    assert sorted(by_server["pagoda"]) == sorted(by_server["offline"]) == expected
    offline = [s for s in result["summaries"] if s["server"] == "offline"]
    assert [s["level"] for s in offline] == [1, 2]
    assert all(s["ok"] == 4 and s["server_split_ms"] is None for s in offline)
    assert [len(s["paired"]["rounds"]) for s in offline] == [2, 2]  # 4 requests: 2 rounds of 2 (of 2 clients each)
    assert all(s["paired"]["median"]["out_tok_per_s"] > 0 for s in offline)
    assert [r["level"] for r in result["offline_ratios"]] == [1, 2]
    assert all(r["out tok/s"] > 0 for r in result["offline_ratios"])
    out = capsys.readouterr().out
    assert "| 1 | offline | 4/4 |" in out and "| 2 | pagoda / offline |" in out
    assert "concurrency 2: pagoda / offline, median of 2 interleaved rounds: out tok/s" in out


def test_the_offline_baseline_needs_the_pagoda_started_here(tiny_server):
    with pytest.raises(SystemExit):
        main(["--url", tiny_server.url, "--offline-baseline"])
    with pytest.raises(SystemExit):
        main(["--offline-baseline", "--offline-rounds", "0"])
