"""`pagoda bench roofline` as a smoke test: two formats (float32, and the default's GGUF blocks with its decode
steps replayed), one row, one step; the bound is computed, never timed."""

import json

from pagoda.bench.roofline import main


def test_the_roofline_measures_the_machine_and_puts_a_step_against_its_bound(default_model_dir, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["--model", str(default_model_dir), "--formats", "float32,gguf", "--rows", "1", "--steps", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["copy_bytes_per_s"] > 0 and result["read_bytes_per_s"] > 0
    for name in ("float32", "gguf"):
        entry = result["formats"][name]
        [step] = entry["steps"]
        # one row reads every matmul weight once: the memory bound is at least the weights over the read bandwidth
        assert step["memory_s"] >= entry["matmul_bytes"] / result["read_bytes_per_s"] > 0
        assert step["compute_s"] > 0 and step["step_s"] > 0
    assert result["formats"]["gguf"]["matmul_bytes"] < result["formats"]["float32"]["matmul_bytes"] / 4
    assert "fraction of the bound" in capsys.readouterr().out
