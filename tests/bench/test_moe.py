"""`pagoda bench moe` as a smoke test: tiny models, two row counts, one round; the figures are there, never judged."""

import json

from pagoda.bench.moe import main

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "256",
        "--experts", "8", "--top-k", "2", "--moe-intermediate", "32", "--context", "8"]


def test_the_moe_bench_times_both_models_at_each_row_count(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main([*TINY, "--rows", "1,4", "--rounds", "1", "--steps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [p["rows"] for p in result["points"]] == [1, 4]
    for point in result["points"]:
        assert point["moe"]["step_s"] > 0 and point["dense"]["step_s"] > 0
        assert 2 <= point["moe"]["experts_hit_per_layer"] <= 8  # top-2 of 8: at least two experts run
        assert "experts_hit_per_layer" not in point["dense"]
    # the same active size: the dense MLP is top_k x moe_intermediate wide, the rest alike
    moe, dense = result["moe_config"], result["dense_config"]
    assert dense["intermediate_size"] == moe["num_experts_per_tok"] * moe["moe_intermediate_size"] == 64
    assert dense["num_experts"] == 0 and moe["moe_layers"] == [0, 1]
    assert result["matmul_bytes"]["moe"] > result["matmul_bytes"]["dense"]
    assert "| rows | MoE ms | dense ms |" in capsys.readouterr().out
