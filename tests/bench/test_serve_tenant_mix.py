"""`pagoda bench serve --tenant-mix`: parsing, the keys file it writes, the share while active on synthetic
records, and one small live run of two policies on the tiny random model."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from pagoda.api.keys_file import read_keys_file
from pagoda.bench.serve import load
from pagoda.bench.serve import tenant_mix as mix
from pagoda.bench.serve.client import RequestRecord, Target
from pagoda.bench.serve.load import LevelRun
from pagoda.bench.serve.sweep import main, parse_args
from pagoda.bench.serve.workloads import Prompt


def test_a_tenant_mix_is_names_and_stream_counts():
    assert mix.parse_tenant_mix("A:64,B:1") == (mix.TenantLoad("A", 64), mix.TenantLoad("B", 1))
    assert mix.parse_tenant_mix(" team-a:3 , team.b:2 ") == (mix.TenantLoad("team-a", 3),
                                                              mix.TenantLoad("team.b", 2))
    for bad in ("A:64", "A:64,A:1", "A:0,B:1", "A,B:1", "A:x,B:1", "A b:1,B:1", "", ":1,B:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            mix.parse_tenant_mix(bad)


def test_the_neighbour_is_the_quietest_tenant_the_last_named_on_a_tie():
    assert mix.neighbour(mix.parse_tenant_mix("A:64,B:1")) == "B"
    assert mix.neighbour(mix.parse_tenant_mix("B:1,A:64")) == "B"
    assert mix.neighbour(mix.parse_tenant_mix("A:2,B:2,C:5")) == "B"


def test_policies_are_a_comma_list_and_the_arguments_are_checked():
    assert mix.parse_policies("fcfs,fair") == ("fcfs", "fair")
    with pytest.raises(argparse.ArgumentTypeError):
        mix.parse_policies("fair,fair")
    args = parse_args(["--tenant-mix", "A:64,B:1", "--scheduling-policy", "fcfs,fair"])
    assert args.tenant_mix == (mix.TenantLoad("A", 64), mix.TenantLoad("B", 1))
    assert args.scheduling_policy == ("fcfs", "fair")
    for bad in (["--tenant-mix", "A:2,B:1", "--url", "http://127.0.0.1:1"],
                ["--tenant-mix", "A:2,B:1", "--workload", "paragraphs"],
                ["--tenant-mix", "A:2,B:1", "--api-key", "k"],
                ["--scheduling-policy", "fcfs,fair"]):  # a list without a mix
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert parse_args(["--scheduling-policy", "fair"]).scheduling_policy == ("fair",)


def test_the_keys_file_holds_each_keys_hash_at_weight_one(tmp_path: Path):
    path = tmp_path / "keys.json"
    keys = mix.write_keys_file(path, ["A", "B"])
    assert set(keys) == {"A", "B"} and keys["A"] != keys["B"] and len(keys["A"]) >= 32
    assert all(key not in path.read_text() for key in keys.values())  # only the hashes are written
    tenants = {t.name: t for t in read_keys_file(path)}  # what `pagoda serve --api-keys-file` reads
    for name, key in keys.items():
        assert tenants[name].key_digest == hashlib.sha256(key.encode()).digest()
        assert tenants[name].weight == 1
    assert path.stat().st_mode & 0o077 == 0
    assert mix.write_keys_file(tmp_path / "again.json", ["A"])["A"] != keys["A"]  # fresh keys each run


def test_max_running_is_the_last_on_the_command_line_or_the_default():
    assert mix.max_running(["pagoda", "serve"]) == 64
    assert mix.max_running(["serve", "--max-running", "16", "--max-running=2"]) == 2
    assert mix.max_running(["serve", "--max-running=8", "--max-running", "4"]) == 4


def test_the_fair_share_water_fills_slots_over_streams():
    assert mix.fair_slots({"A": 64, "B": 1}, 16) == {"A": 15.0, "B": 1.0}
    assert mix.fair_share({"A": 64, "B": 1}, 16)["B"] == pytest.approx(1 / 16)
    assert mix.fair_share({"A": 64, "B": 1}, 2) == {"A": 0.5, "B": 0.5}
    assert mix.fair_share({"A": 3, "B": 1}, 64) == {"A": 0.75, "B": 0.25}  # room for all: each stream a slot
    assert mix.fair_slots({"A": 64, "B": 4, "C": 1}, 9) == {"C": 1.0, "B": 4.0, "A": 4.0}


def rec(start: float, ttft: float, gaps: list[float], tokens: int | None = None, ok: bool = True,
        tenant: str = "A") -> RequestRecord:
    events = 1 + len(gaps)
    return RequestRecord("pagoda", 1, 0, start, ok=ok, ttft=ttft, itl=gaps,
                         e2e=ttft + sum(gaps) if ok else None, output_tokens=events if tokens is None else tokens,
                         tenant=tenant)


def test_token_events_spread_a_requests_tokens_over_its_events():
    r = rec(1.0, 0.5, [0.25, 0.25], tokens=6)  # three events, two tokens each (drafts accepted)
    assert mix.token_events(r) == [(1.5, 2.0), (1.75, 2.0), (2.0, 2.0)]
    stopped = rec(1.0, 0.5, [0.5], tokens=0, ok=False)  # cut off: one token per event it streamed
    assert mix.token_events(stopped) == [(1.5, 1.0), (2.0, 1.0)]
    assert mix.token_events(RequestRecord("pagoda", 1, 0, 0.0)) == []


def test_active_spans_merge_and_an_unfinished_request_ends_at_its_last_event_or_the_end():
    a, b = rec(0.0, 1.0, [1.0]), rec(1.5, 1.0, [])  # [0, 2] and [1.5, 2.5] overlap
    queued = RequestRecord("pagoda", 1, 0, 5.0)  # never streamed: in flight to the end
    assert mix.active_spans([b, a, queued], end=9.0) == [(0.0, 2.5), (5.0, 9.0)]
    assert mix.tokens_within([a, b], [(0.0, 1.5)]) == 1  # a's first token at 1.0; a's second at 2.0 is outside


def test_the_share_counts_everyones_tokens_inside_the_neighbours_spans_only():
    # B is active over [10, 14]: 4 tokens of its own; A streams one token a second from 0 to 19.
    b = rec(10.0, 1.0, [1.0, 1.0, 1.0], tenant="B")  # tokens at 11, 12, 13, 14
    a = [rec(float(s), 0.0, [], tenant="A") for s in range(20)]  # a token at every whole second
    by = {"A": a, "B": [b]}
    # inside [10, 14]: A's tokens at 10..14 (5), B's 4: B's share 4/9
    assert mix.share_while_active(by, "B", end=20.0) == pytest.approx(4 / 9)
    assert mix.share_while_active(by, "A", end=20.0) == pytest.approx(20 / 24)  # A is active all along
    assert mix.share_while_active({"A": [], "B": []}, "B", end=1.0) is None


def test_a_policy_summary_and_its_table():
    alone = LevelRun([rec(0.0, 0.1, [0.1], tenant="B"), rec(0.2, 0.1, [0.1], tenant="B")], 0.4)
    b = rec(10.0, 0.3, [1.0], tenant="B")
    a = [rec(float(s), 0.5, [0.5], tenant="A") for s in range(12)]
    a.append(RequestRecord("pagoda", 4, 12, 11.0, error=load.STOPPED, tenant="A"))
    health = ({"steps_total": 10, "generated_tokens_total": 5, "preemptions_total": 1, "peak_running": 2},
              {"steps_total": 40, "generated_tokens_total": 35, "preemptions_total": 4, "peak_running": 16})
    s = mix.summarize("fair", alone, {"A": LevelRun(a, 12.0), "B": LevelRun([b], 12.0)}, {"A": 4, "B": 1}, "B",
                      16, health)
    assert s["neighbour_ttft_ratio"] == pytest.approx(3.0)  # 300 ms against 100 ms alone
    assert s["tenants"]["A"]["requests"] == 12 and s["tenants"]["A"]["stopped"] == 1
    assert s["tenants"]["A"]["failed"] == 0 and s["errors"] == []
    assert s["tenants"]["B"]["fair_share"] == pytest.approx(0.2)  # 16 slots, 5 streams: each its own
    assert s["server"] == {"steps": 30, "generated_tokens": 30, "preemptions": 3, "peak_running": 16}
    assert s["tenants"]["A"]["generated_tokens"] == 24 and s["others_out_tok_per_s"] == pytest.approx(2.0)
    out = mix.table([s])
    assert "| fair | B | 1 | 1 | 0 | 300 |" in out and "| fair | 100 | 300 | 3.00x |" in out


def test_prompts_differ_between_phases_tenants_and_requests_and_repeat_for_a_seed():
    alone, in_mix = mix.prompts(0, "alone", 8, 4), mix.prompts(0, "mix", 8, 4)
    texts = {f(t, i).text for f in (alone, in_mix) for t in ("A", "B") for i in range(5)}
    assert len(texts) == 20
    assert alone("B", 3) == mix.prompts(0, "alone", 8, 4)("B", 3) and len(alone("B", 3).text.split()) == 8


def test_think_time_pauses_are_exponential_seeded_and_none_at_zero():
    assert mix.pauses(0, "mix", 0.0) is None
    pause = mix.pauses(0, "mix", 0.02)
    values = [pause(t, i) for t in "AB" for i in range(500)]
    assert len(set(values)) == len(values) and min(values) >= 0
    assert 0.015 < sum(values) / len(values) < 0.025  # mean 20 ms
    assert pause("B", 7) == mix.pauses(0, "mix", 0.02)("B", 7) != mix.pauses(0, "alone", 0.02)("B", 7)
    assert parse_args(["--tenant-mix", "A:4,B:1", "--think-time", "0.02"]).think_time == 0.02


def run_loops(server, streams: dict[str, int], max_tokens: int, **kw) -> dict[str, LevelRun]:
    """tenant_loops against a live server without keys, until B has sent and finished 3 requests."""
    async def go():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            targets = {name: Target("pagoda", server.url, model=server.model_name) for name in streams}
            cfg = load.LoadConfig(progress=False, request_timeout=60)
            return await load.tenant_loops(http, targets, streams, cfg,
                                           lambda t, i: Prompt(f"{t} {i} hello", max_tokens), "B", 3,
                                           asyncio.get_running_loop().time() + 60, **kw)

    return asyncio.run(go())


def test_tenant_loops_pause_before_each_request(tiny_server):
    """A pause of 0.3 s before each of the neighbour's requests: each one starts at least that long after the
    one before it ended, on the loops' own clock."""
    b = sorted(run_loops(tiny_server, {"A": 1, "B": 1}, 2, pause=lambda t, i: 0.3)["B"].records,
               key=lambda r: r.start)
    assert len(b) == 3 and all(r.ok for r in b) and b[0].start >= 0.3
    assert all(later.start - (earlier.start + earlier.e2e) >= 0.3 for earlier, later in zip(b, b[1:]))


def test_tenant_loops_stop_the_others_when_the_neighbour_is_done(tiny_server):
    """Against a live server without keys: the neighbour's requests run to their count, the other tenant's loop
    is stopped then, and every record names its tenant on one clock."""
    runs = run_loops(tiny_server, {"A": 3, "B": 1}, 4)
    b, a = runs["B"].records, runs["A"].records
    assert [r.index for r in b] == [0, 1, 2] and all(r.ok and r.tenant == "B" for r in b)
    assert a and all(r.tenant == "A" and (r.ok or r.error == load.STOPPED) for r in a)
    last_b_end = max(r.start + r.e2e for r in b)
    assert all(r.start <= last_b_end + 0.5 for r in a)  # nothing of A's began after B was done
    assert not runs["B"].deadline_hit


@pytest.mark.slow
def test_two_policies_live_with_two_keys(tiny_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "mix.json"
    code = main(["--no-progress", "--model", str(tiny_model_dir), "--num-blocks", "64", "--max-running", "2",
                 "--server-arg=--dtype=float32", "--tenant-mix", "A:4,B:1", "--scheduling-policy", "fcfs,fair",
                 "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--request-timeout", "60",
                 "--deadline", "240", "--json", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    result = json.loads(out.read_text())
    assert [s["policy"] for s in result["summaries"]] == ["fcfs", "fair"]
    for s in result["summaries"]:
        assert s["neighbour"] == "B" and s["alone"]["requests"] == 3 and s["max_running"] == 2
        assert s["tenants"]["B"]["requests"] == 3 and s["tenants"]["A"]["requests"] >= 1
        assert 0 < s["tenants"]["B"]["share_while_active"] < 1 and s["neighbour_ttft_ratio"] > 0
        assert s["tenants"]["B"]["fair_share"] == 0.5 and s["server"]["peak_running"] <= 2
    records = result["records"]
    assert {(r["policy"], r["phase"], r["tenant"]) for r in records} == {
        (p, "alone", "B") for p in ("fcfs", "fair")} | {(p, "mix", t) for p in ("fcfs", "fair") for t in "AB"}
    printed = capsys.readouterr().out
    assert "| fcfs | B |" in printed and "| fair | B |" in printed and "x alone" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plots" / "tenant_mix.png").stat().st_size > 0
