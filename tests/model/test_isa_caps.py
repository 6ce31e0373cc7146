"""Every weight format's products stay row invariant at every row count 1..300 under each oneDNN ISA cap this
CPU supports (and MKL capped alike): the start-up probe finds each cap's switch points and the calls are capped
below them. A cap the CPU lacks skips, saying which flag is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.core.machine import cpu_facts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# (oneDNN's cap, the /proc/cpuinfo flag it needs, MKL's cap alongside)
CAPS = [("AVX2", "avx2", "AVX2"), ("AVX512_CORE", "avx512f", "AVX512"),
        ("AVX512_CORE_BF16", "avx512_bf16", "AVX512"), ("AVX512_CORE_AMX", "amx_bf16", "AVX512")]


@pytest.mark.parametrize("cap, flag, mkl", CAPS, ids=[c[0] for c in CAPS])
def test_every_format_is_row_invariant_at_every_row_count_under_the_cap(cap, flag, mkl, tmp_path):
    if flag not in cpu_facts().flags:
        pytest.skip(f"this CPU lacks {flag}: ONEDNN_MAX_CPU_ISA={cap} cannot run here")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "MKL_ENABLE_INSTRUCTIONS": mkl, "PAGODA_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.model.row_scan"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(cap, result)
    assert "mkl" in result and len(result) >= 2, result
    assert {name: r["differs"] for name, r in result.items() if r["differs"]} == {}
    if cap == "AVX512_CORE_AMX":  # the line this scan must cross: bfloat16 on AMX tiles from 33 rows
        assert result["onednn_bf16"]["switch"] is not None, result
