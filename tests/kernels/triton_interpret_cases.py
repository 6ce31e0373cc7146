"""Run the Triton kernels under the interpreter on small float32 cases; one line per case.

Run as `TRITON_INTERPRET=1 python -m tests.kernels.triton_interpret_cases` (test_triton_interpret.py
does so in a subprocess, since the variable must be set before triton compiles the kernels).
Exits non-zero when a case's relative error against the reference reaches 1e-5.
"""

from __future__ import annotations

import os
import sys

import torch

from pagoda.kernels.reference import reference_attention
from pagoda.kernels.triton_backend import TritonBackend
from pagoda.kernels.triton_decode import SPLIT_SIZE

from .attention_world import World, rel_err

TOLERANCE = 1e-5

# name: (seq_lens, items (seq, start, n), heads, kv heads, head dim, block size[, sliding window, softcap])
CASES = {
    "decode_gqa3_split": ([5, SPLIT_SIZE + 88, 33, 64], [(0, 4, 1), (1, SPLIT_SIZE + 87, 1), (2, 32, 1), (3, 63, 1)],
                          6, 2, 64, 16),
    "decode_mha_d128": ([SPLIT_SIZE + 1, 17], [(0, SPLIT_SIZE, 1), (1, 16, 1)], 2, 2, 128, 16),
    "mixed_gqa4_prefix": ([80, 40, 23], [(0, 33, 47), (1, 39, 1), (2, 0, 23)], 8, 2, 64, 16),
    "mixed_gqa8_block48_d80": ([100, 49], [(0, 50, 50), (1, 48, 1)], 8, 1, 80, 48),
    # sliding windows (positions before each one's start left NaN) and soft-capping: a split wholly before
    # the window, a window larger than the context, W = 1, and prefill rows that see nothing in their first tiles
    "decode_gqa3_window50": ([5, SPLIT_SIZE + 88, 33], [(0, 4, 1), (1, SPLIT_SIZE + 87, 1), (2, 32, 1)],
                             6, 2, 64, 16, 50, 0.0),
    "decode_window1_softcap": ([SPLIT_SIZE + 88, 33], [(0, SPLIT_SIZE + 87, 1), (1, 32, 1)], 4, 2, 64, 16, 1, 2.0),
    "mixed_gqa4_window3_softcap": ([80, 40, 23], [(0, 33, 47), (1, 39, 1), (2, 0, 23)], 8, 2, 64, 16, 3, 1.5),
    "mixed_gqa8_block48_window20": ([100, 49], [(0, 50, 50), (1, 48, 1)], 8, 1, 80, 48, 20, 0.0),
    "mixed_softcap_only": ([80, 40], [(0, 33, 47), (1, 39, 1)], 4, 2, 64, 16, 0, 1.5),
}  # fmt: skip


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    backend, failed = TritonBackend(), 0
    for name, (lens, items, heads, kv_heads, dim, block_size, *options) in CASES.items():
        window, softcap = options or (0, 0.0)
        world = World(lens, heads, kv_heads, dim, block_size=block_size, seed=len(name))
        step = world.batch(items, window=window)
        out = backend.attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                                sliding_window=window, softcap=softcap)
        ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                                  sliding_window=window, softcap=softcap)
        err = rel_err(out, ref) if torch.isfinite(out).all() else float("inf")
        splits = -(-step.meta.max_seq_len // SPLIT_SIZE) if step.meta.max_query_len == 1 else 0
        print(f"case {name} max_query_len={step.meta.max_query_len} splits={splits} window={window} "
              f"softcap={softcap} rel_err={err:.3e}")
        failed += not err < TOLERANCE
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
