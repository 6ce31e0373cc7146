"""`pagoda bench fleet`'s parts that need no server: the conversations' pauses, the simulator crowd built from
them, the prediction and the arguments (the live half runs as the performance page says, not in the suite)."""

from __future__ import annotations

import json

import pytest

from pagoda.bench.fleet import chat_crowd_from, main, parse_args, predict
from pagoda.bench.serve.workloads import conversations
from pagoda.core.tokenizer import Tokenizer
from pagoda.model.hub import resolve_model
from tests.server_fixtures import tiny_model_dir  # noqa: F401


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("default", progress=False))


def test_pauses_keep_the_words_of_the_seed_and_are_drawn_from_it():
    plain = conversations(4, 3, 8, 10, seed=5)
    paused = conversations(4, 3, 8, 10, seed=5, think_s=2.0)
    assert [(c.system, c.user_turns) for c in paused] == [(c.system, c.user_turns) for c in plain]
    assert all(c.think_s == () for c in plain)
    assert all(len(c.think_s) == 3 and all(s > 0 for s in c.think_s) for c in paused)
    assert paused == conversations(4, 3, 8, 10, seed=5, think_s=2.0)
    assert paused != conversations(4, 3, 8, 10, seed=6, think_s=2.0)
    many = [s for c in conversations(200, 5, 1, 1, seed=0, think_s=2.0) for s in c.think_s]
    assert 1.7 < sum(many) / len(many) < 2.3  # exponential pauses of that mean


def test_the_crowd_resends_each_conversation_as_the_chat_template_renders_it(tokenizer):
    convs = conversations(3, 3, 8, 12, seed=1, think_s=1.5)
    plans = chat_crowd_from(convs, tokenizer, output_len=5)
    assert [p.client_id for p in plans] == [f"c{c}t{t}" for c in range(3) for t in range(3)]
    for c, conv in enumerate(convs):
        own = plans[3 * c:3 * c + 3]
        assert [p.after for p in own] == [None, f"c{c}t0", f"c{c}t1"]
        assert [p.arrival for p in own] == list(conv.think_s)
        messages = [{"role": "system", "content": conv.system}]
        for t, user in enumerate(conv.user_turns):
            messages.append({"role": "user", "content": user})
            rendered = tokenizer.encode_chat(messages, add_generation_prompt=True)
            # the engine's prompt for a follow-up is the previous prompt + its answer + this turn's own tokens
            assert sum(len(p.prompt) for p in own[:t + 1]) + 5 * t == len(rendered)
            messages.append({"role": "assistant", "content": " ".join(["pagoda"] * 5)})
        assert all(p.max_tokens == 5 and p.ignore_eos for p in own)


def test_the_prediction_prefix_hits_more_than_round_robin_and_audits_clean(tokenizer):
    plans = chat_crowd_from(conversations(8, 3, 8, 40, seed=0, think_s=1.0), tokenizer, output_len=4)
    rr, prefix = (predict(plans, policy, replicas=2, num_blocks=256, block_size=16)
                  for policy in ("round_robin", "prefix"))
    assert rr["routes"] == {"round_robin": len(plans)}
    assert sum(prefix["routes"].values()) == len(plans) and prefix["routes"].get("match", 0) > 0
    assert prefix["prefix_hit_rate"] > rr["prefix_hit_rate"] > 0


def test_arguments_are_checked():
    assert parse_args([]).policies == ["round_robin", "prefix"]
    with pytest.raises(SystemExit):
        parse_args(["--policies", "random"])
    with pytest.raises(SystemExit):
        parse_args(["--replicas", "0"])


@pytest.mark.slow
def test_a_small_live_fleet_runs_both_policies_through_the_router(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    """The whole bench on the tiny model: two `pagoda serve` children and a router per policy, the chat workload
    through it, the fleet's counters read back, the prediction beside them."""
    out = tmp_path / "fleet.json"
    rc = main(["--model", str(tiny_model_dir), "--conversations", "4", "--turns", "2", "--system-tokens", "4",
               "--user-tokens", "40", "--output-len", "4", "--think-time", "0.05", "--num-blocks", "64",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    live = {run["policy"]: run for run in result["live"]}
    assert set(live) == {"round_robin", "prefix"}
    for run in live.values():
        assert run["ok"] == run["requests"] == 8 and run["failed"] == 0
        assert sum(run["requests_per_replica"]) == 8 and run["kv_blocks_per_replica"] == 64
        assert run["queried_tokens"] > 0 and 0 <= run["prefix_hit_rate"] <= 1
    assert live["round_robin"]["requests_per_replica"] == [4, 4]
    assert live["prefix"]["hit_tokens"] > 0  # a second turn found its first turn's blocks where the router sent it
    simulated = {run["policy"]: run for run in result["simulated"]}
    assert simulated["round_robin"]["routes"] == {"round_robin": 8} and sum(simulated["prefix"]["routes"].values()) == 8
    assert "hit-rate ratio prefix / round_robin" in capsys.readouterr().out
