"""The Triton kernels on the CPU, under TRITON_INTERPRET=1, against the reference (float32, small shapes).

The interpreter is chosen when triton decorates a kernel, so the cases run in a subprocess with the
variable set: this process may already have imported the kernels compiled for a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.triton_interpret
def test_triton_kernels_match_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_interpret_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = dict(re.findall(r"^case (\S+) (.*)$", proc.stdout, re.M))
    assert len(cases) == 9, proc.stdout
    # the hard paths ran: split-K decode with more than one split, and chunks after a cached prefix
    assert "splits=2" in cases["decode_gqa3_split"] and "splits=2" in cases["decode_mha_d128"]
    assert "max_query_len=47" in cases["mixed_gqa4_prefix"]
    # and with sliding windows (a split wholly before one, W = 1, W = 3 in a prefill) and soft-capping
    assert "splits=2 window=50" in cases["decode_gqa3_window50"]
    assert "window=1 softcap=2.0" in cases["decode_window1_softcap"]
    assert "max_query_len=47 splits=0 window=3" in cases["mixed_gqa4_window3_softcap"]
    assert all(float(re.search(r"rel_err=(\S+)", v).group(1)) < 1e-5 for v in cases.values())
