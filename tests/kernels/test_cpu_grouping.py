"""Short prefill chunks folded together in one row set, at either thread count: same bits as alone."""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels.cpu_plan as plan_mod
from pagoda.kernels.cpu_attention import CpuBackend
from pagoda.kernels.cpu_plan import AttentionPlan

from .attention_world import World
from .test_cpu_attention import run_cpu

LENS = [20, 13, 64, 65, 7, 33, 2, 1100]  # the last spans two default key chunks: never grouped


@pytest.fixture(scope="module")
def world():
    return World(LENS, num_heads=9, num_kv_heads=3, head_dim=64, seed=7)


@pytest.fixture(scope="module")
def alone(world):
    """Every row of every sequence, as one whole-prompt prefill per sequence, alone."""
    return [run_cpu(world.batch([(i, 0, n)])) for i, n in enumerate(LENS)]


def plan_of(step):
    return AttentionPlan.build(step.meta, step.k_cache.shape[1], 3, 3, 64)


def test_short_prefills_share_one_row_set_and_keep_their_bits(world, alone):
    items = [(i, 0, n) for i, n in enumerate(LENS[:7])]  # seven prompts of unequal length at once
    step = world.batch(items)
    assert len(plan_of(step).row_sets) == 1
    out = run_cpu(step)
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(out[step.rows_of(j)], alone[i][s : s + n]), i


def test_grouped_chunks_after_cached_prefixes_beside_decodes_and_a_long_chunk(world, alone):
    # chunks at offsets, of equal and unequal lengths, in an order the plan sorts, with decodes and
    # a two-chunk prompt in the same step
    items = [(2, 40, 24), (7, 0, 1100), (0, 5, 15), (5, 1, 1), (3, 60, 5), (1, 0, 13), (6, 0, 2), (4, 3, 4)]
    step = world.batch(items)
    plan = plan_of(step)
    assert [len(rs.seqs) for rs in plan.row_sets] == [1, 6, 1]  # the decode, the six short chunks, the long one
    out = run_cpu(step)
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(out[step.rows_of(j)], alone[i][s : s + n]), (i, s, n)


def test_equal_length_chunks_group_without_padding(world, alone):
    items = [(0, 7, 13), (1, 0, 13), (5, 20, 13)]
    step = world.batch(items)
    (rs,) = plan_of(step).row_sets
    assert rs.real is None and isinstance(rs.tokens, slice)  # contiguous, every token real
    out = run_cpu(step)
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(out[step.rows_of(j)], alone[i][s : s + n]), i


def test_the_budget_splits_groups_without_changing_bits(world, alone, monkeypatch):
    items = [(i, 0, n) for i, n in enumerate(LENS[:7])]
    want = run_cpu(world.batch(items))
    monkeypatch.setattr(plan_mod, "SCORE_BUDGET", 3 * 4 * 64 * 64)  # at most four short chunks of <= 64 keys
    step = world.batch(items)
    assert len(plan_of(step).row_sets) > 1
    assert torch.equal(run_cpu(step), want)


def test_backend_attention_at_either_thread_count_gives_the_same_bits(world, alone):
    items = [(i, 0, n) for i, n in enumerate(LENS[:7])] + [(7, 1099, 1)]
    step = world.batch(items)
    results = []
    threads = torch.get_num_threads()
    for n in (1, max(2, threads)):  # the runner's one-thread switch (pagoda/model/runner.py), and the full count
        torch.set_num_threads(n)
        try:
            results.append(CpuBackend(native=False).attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(results[0][step.rows_of(j)], alone[i][s : s + n]), i
