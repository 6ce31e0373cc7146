"""`pagoda bench kernels` on a tiny CPU grid: tables print, measurements are sane."""

from __future__ import annotations

import json

from pagoda.bench import kernels as bench


def test_quick_cpu_bench_prints_tables_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--quick", "--reps", "1", "--threads", "1", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| batch | context | cpu ms | cpu_sdpa ms | reference ms |" in text
    assert "| prefill tokens |" in text and "cpu/cpu_sdpa" in text
    result = json.loads(path.read_text())
    assert len(result["decode"]) == 2 and len(result["prefill"]) == 1
    assert all(result["check"][name] < 1e-5 for name in ("cpu", "cpu_sdpa"))
    assert all(row["cpu"] > 0 and row["gbps"] > 0 for row in result["decode"])


def test_gpu_defaults_use_the_full_grid_in_bfloat16():
    args = bench.parse_args(["--device", "cuda"])
    assert args.dtype == "bfloat16" and args.batches == bench.GPU_GRID["batches"]
    assert max(args.contexts) == 32768 and (args.heads, args.kv_heads) == (32, 8)
