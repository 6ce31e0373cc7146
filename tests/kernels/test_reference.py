"""The oracle itself, checked against dense causal SDPA on contiguous tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.reference import ReferenceBackend

from .attention_world import World, rel_err


def dense(world, i, start, n):
    """Rows start..start+n-1 of sequence i by dense causal attention over its whole prefix."""
    end = start + n
    group = world.num_heads // world.num_kv_heads
    q = world.q[i][:end].transpose(0, 1).double()  # [H, end, D]
    k = world.k[i][:end].repeat_interleave(group, 1).transpose(0, 1).double()
    v = world.v[i][:end].repeat_interleave(group, 1).transpose(0, 1).double()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=world.scale)
    return out.transpose(0, 1)[start:end]


def test_reference_matches_dense_causal_attention():
    world = World([40, 17, 9], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, seed=7)
    items = [(0, 20, 20), (1, 16, 1), (2, 0, 9)]
    step = world.batch(items)
    out = ReferenceBackend().attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    for j, (i, s, n) in enumerate(items):
        assert rel_err(out[step.rows_of(j)], dense(world, i, s, n)) < 1e-6
