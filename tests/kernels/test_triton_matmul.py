"""The batch-invariant Triton matmul (and the invariant attention backend) under TRITON_INTERPRET=1 on the CPU.

The interpreter is chosen when triton decorates a kernel, so the cases run in a subprocess with the variable
set (`python -m tests.kernels.test_triton_matmul`, the `main` below): float32, tiny shapes. A row alone must
equal the same row inside batches of other sizes bitwise, at every position in a tile, with and without
split-K and bias; every product must be close to the float64 reference. The invariant attention backend must
give a sequence's decode row the same bits alone and beside a prefill chunk (where the plain backend switches
kernels). On a GPU, tests/kernels/test_triton_gpu.py checks the same in bfloat16.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.triton_interpret
def test_triton_matmul_and_invariant_attention_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_triton_matmul"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = dict(re.findall(r"^case (\S+) (.*)$", proc.stdout, re.M))
    assert len(cases) == 6, proc.stdout
    assert all(v.endswith(" ok") for v in cases.values()), proc.stdout
    assert "split_k=3" in cases["split3_bias"] and "split_k=1" in cases["split1"]


def test_config_never_depends_on_the_row_count():
    pytest.importorskip("triton")
    import torch

    from pagoda.kernels.triton_matmul import config_for

    # the signature has no row count: a weight's config is all there is; the decode-shaped ones split K
    assert config_for(4096, 4096, torch.bfloat16).split_k > 1  # 64 column tiles: too few programs alone
    assert config_for(28672, 4096, torch.bfloat16).split_k == 1  # 448 column tiles
    assert config_for(40, 8, torch.float32).split_k == 1  # K too short to split


def _matmul_cases() -> int:
    import torch

    from pagoda.kernels.triton_matmul import MatmulConfig, config_for, linear, reference_linear

    failed = 0
    gen = torch.Generator().manual_seed(0)
    # name: (out, in, bias, config): tiles of 16 rows so a batch of 40 spans three row tiles
    cases = {
        "split1": (40, 72, False, MatmulConfig(16, 16, 16, 1)),
        "split3_bias": (24, 100, True, MatmulConfig(16, 16, 16, 3)),
        "default_config": (40, 72, True, None),
        "ragged_out": (37, 45, True, MatmulConfig(16, 32, 16, 2)),
    }
    for name, (n_out, n_in, has_bias, cfg) in cases.items():
        weight = torch.randn(n_out, n_in, generator=gen)
        bias = torch.randn(n_out, generator=gen) if has_bias else None
        x = torch.randn(40, n_in, generator=gen)
        full = linear(x, weight, bias, cfg)
        err = ((full.double() - reference_linear(x, weight, bias).double()).norm() / full.double().norm()).item()
        same = True
        for rows in (1, 3, 17):  # row r alone and in batches where it sits at other offsets and tiles
            for r in (0, 16, 39):
                start = max(0, r - rows + 1)
                part = linear(x[start : start + rows], weight, bias, cfg)
                alone = linear(x[r : r + 1], weight, bias, cfg)
                same &= torch.equal(part[r - start], full[r]) and torch.equal(alone[0], full[r])
        split = (cfg or config_for(n_out, n_in, torch.float32)).split_k
        ok = same and err < 1e-5
        print(f"case {name} split_k={split} rel_err={err:.2e} row_invariant={same} {'ok' if ok else 'FAILED'}")
        failed += not ok
    return failed


def _attention_cases() -> int:
    import torch

    from pagoda.kernels.reference import reference_attention
    from pagoda.kernels.triton_backend import TritonBackend
    from pagoda.kernels.triton_decode import SPLIT_SIZE

    from .attention_world import World, rel_err

    failed = 0
    lens = [SPLIT_SIZE + 40, 90, 30]
    world = World(lens, num_heads=6, num_kv_heads=2, head_dim=64, seed=5)
    plain, invariant = TritonBackend(), TritonBackend(invariant=True)
    decode = [(0, lens[0] - 1, 1)]
    mixed = [(1, 10, 80), (0, lens[0] - 1, 1), (2, 0, 30)]  # the decode beside two prefill chunks
    for name, backend in (("attention_plain", plain), ("attention_invariant", invariant)):
        alone = backend.attention(*_args(world.batch(decode)))
        step = world.batch(mixed)
        crowd = backend.attention(*_args(step))
        same = torch.equal(alone[0], crowd[step.rows_of(1)][0])
        err = rel_err(crowd, reference_attention(*_args(step)))
        # the invariant backend must be bitwise; the plain one switches kernels (equal only to rounding)
        ok = err < 1e-5 and (same or backend is plain)
        print(f"case {name} decode_alone_equals_crowd={same} rel_err={err:.2e} {'ok' if ok else 'FAILED'}")
        failed += not ok
    return failed


def _args(step):
    return step.q, step.k_cache, step.v_cache, step.meta, step.scale


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    return 1 if _matmul_cases() + _attention_cases() else 0


if __name__ == "__main__":
    sys.exit(main())
