"""The non-invariant SDPA variant is still correct attention."""

from __future__ import annotations

import torch

from pagoda.kernels.cpu_sdpa import SdpaBackend
from pagoda.kernels.reference import reference_attention

from .attention_world import World, rel_err


def test_sdpa_backend_matches_reference_on_a_mixed_poisoned_batch():
    world = World([130, 64, 17, 90], num_heads=8, num_kv_heads=2, head_dim=64, seed=8)
    step = world.batch([(0, 60, 70), (1, 63, 1), (2, 16, 1), (3, 0, 90)])
    out = SdpaBackend().attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-6
