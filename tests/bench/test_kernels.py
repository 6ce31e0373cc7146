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
    assert args.dtype == "bfloat16" and args.batches == bench.GPU_GRID["batches"] == [1, 16, 64]
    assert args.contexts == [1024, 4096, 16384] and (args.heads, args.kv_heads, args.head_dim) == (32, 8, 128)


def test_sdpa_yardstick_and_the_decode_sweep_run_on_tiny_cases(monkeypatch):
    # the CUDA-only parts of the grid, on the CPU: SDPA on the gathered K/V equals the reference, and a sweep
    # row per variant (the Triton kernels themselves need a GPU or the interpreter: compile errors become rows)
    import torch

    from pagoda.kernels.reference import reference_attention

    gen = torch.Generator().manual_seed(0)
    shape = (4, 2, 16, 16)
    case = bench.make_case(1, 40, 40, shape, torch.float32, torch.device("cpu"), gen)
    sdpa = bench.sdpa_on_gathered(*case, 0.25)()  # [1, H, T, D]
    ref = reference_attention(*case, 0.25)  # [T, H, D]
    assert torch.allclose(sdpa[0].transpose(0, 1), ref, atol=1e-5)
    monkeypatch.setattr(bench, "SWEEP_POINTS", [(2, 40)])
    rows = bench.sweep(shape, torch.float32, torch.device("cpu"), gen, 1, 1e9, 0.25)
    assert len(rows) == len(bench.SWEEP) and all(("ms" in r) != ("error" in r) for r in rows)
