"""select_backend: chosen once at start-up, by device or by name."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import BACKEND_NAMES, select_backend

from .attention_world import World, rel_err


def test_defaults_to_the_cpu_backend_on_the_cpu():
    assert select_backend(torch.device("cpu")).name == "cpu"
    assert select_backend("cpu", "reference").name == "reference"


def test_rejects_unknown_names_and_cpu_backends_on_other_devices():
    with pytest.raises(ValueError, match="name"):
        select_backend("cpu", "flash")
    with pytest.raises(ValueError, match="cpu"):
        select_backend("cuda", "cpu")


@pytest.mark.parametrize("name", [n for n in BACKEND_NAMES if not n.startswith("triton")])
def test_every_cpu_backend_writes_and_attends(name):
    world = World([20, 5], num_heads=4, num_kv_heads=2, head_dim=64, seed=9)
    step = world.batch([(0, 10, 10), (1, 4, 1)])
    backend = select_backend("cpu", name)
    k_cache, v_cache = torch.full_like(step.k_cache, float("nan")), torch.full_like(step.v_cache, float("nan"))
    ends = [20, 5]
    history = type(step.meta).build(ends, ends, [world.tables[0], world.tables[1]], world.block_size)
    backend.write_kv(k_cache, v_cache, torch.cat([world.k[0], world.k[1]]), torch.cat([world.v[0], world.v[1]]),
                     history.slot_mapping)  # fmt: skip
    assert torch.equal(k_cache.nan_to_num(7.0), step.k_cache.nan_to_num(7.0))
    out = backend.attention(step.q, k_cache, v_cache, step.meta, step.scale)
    ref = select_backend("cpu", "reference").attention(step.q, k_cache, v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < 2e-6
