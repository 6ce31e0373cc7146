"""`pagoda bench roofline` as a smoke test: one format, one row, one step; the bound is computed, never timed."""

import json

from pagoda.bench.roofline import main


def test_the_roofline_measures_the_machine_and_puts_a_step_against_its_bound(default_model_dir, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["--model", str(default_model_dir), "--formats", "float32", "--rows", "1", "--steps", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["copy_bytes_per_s"] > 0 and result["read_bytes_per_s"] > 0
    entry = result["formats"]["float32"]
    [step] = entry["steps"]
    # one row reads every matmul weight once: the memory bound is at least the weights over the read bandwidth
    assert step["memory_s"] >= entry["matmul_bytes"] / result["read_bytes_per_s"] > 0
    assert step["compute_s"] > 0 and step["step_s"] > 0
    assert "fraction of the bound" in capsys.readouterr().out
