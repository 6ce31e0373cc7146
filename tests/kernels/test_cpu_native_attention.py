"""pagoda's C++ paged attention against the reference, and its bitwise batch invariance (torch.equal).

The same comparisons as the torch fold's (test_cpu_attention.py): decode against the row of a whole
prefill, alone against a crowd, any chunking, recompute after preemption, threads, random mixed steps.
The caches are NaN-poisoned outside what each step may read (attention_world.py).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native, select_backend
from pagoda.kernels.cpu_attention import CpuBackend
from pagoda.kernels.reference import reference_attention

from .attention_world import World, rel_err

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")

BOUNDARY_LENS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129]  # around vectors (8) and blocks (16)


def run(step):
    out = cpu_native.paged_attention(step.q, step.k_cache, step.v_cache, step.meta.block_tables,
                                     step.meta.query_start_loc, step.meta.seq_lens, step.scale)
    assert torch.isfinite(out).all(), "a row read a poisoned slot"
    return out


def check_close(step, out, tol=2e-6):
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < tol
    assert (out.double() - ref.double()).abs().max().item() < 20 * tol


def test_the_cpu_backend_runs_it_for_float32():
    backend = select_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.native
    world = World([40, 9], num_heads=6, num_kv_heads=2, head_dim=64, seed=1)
    step = world.batch([(0, 30, 10), (1, 8, 1)])
    assert torch.equal(backend.attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale), run(step))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 256])
def test_prefills_and_decodes_match_the_reference(group, head_dim):
    world = World(BOUNDARY_LENS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, seed=group)
    check_close(world.batch([(i, 0, n) for i, n in enumerate(BOUNDARY_LENS)]), run(world.batch(
        [(i, 0, n) for i, n in enumerate(BOUNDARY_LENS)])))
    decodes = world.batch([(i, n - 1, 1) for i, n in enumerate(BOUNDARY_LENS)])
    check_close(decodes, run(decodes))


@pytest.mark.parametrize("block_size", [1, 4, 48, 128])
def test_block_sizes_and_a_mixed_step(block_size):
    lens = [5, 130, 47, 200, 33]
    world = World(lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size, seed=4)
    step = world.batch([(0, 0, 5), (1, 100, 30), (2, 46, 1), (3, 199, 1), (4, 0, 33)])
    check_close(step, run(step))


def test_a_very_peaked_softmax_and_a_flat_one():
    world = World([300, 300], num_heads=2, num_kv_heads=1, head_dim=64, seed=6)
    world.q[0].mul_(40)  # scores hundreds apart: most weights underflow to exactly 0
    world.q[1].zero_()  # every score equal: the mean of the values
    step = world.batch([(0, 0, 300), (1, 0, 300)])
    out = run(step)
    check_close(step, out, tol=1e-5)
    assert torch.allclose(out[300 + 299], world.v[1][:300].mean(0).repeat_interleave(2, 0).view(2, 64), atol=1e-5)


LENS = [300, 161, 64, 65, 7, 129]


@pytest.fixture(scope="module")
def world():
    return World(LENS, num_heads=9, num_kv_heads=3, head_dim=64, seed=42)


@pytest.fixture(scope="module")
def full_prefill(world):
    """Every row of every sequence, computed as one whole-prompt prefill per sequence, alone."""
    return [run(world.batch([(i, 0, n)])) for i, n in enumerate(LENS)]


def test_a_decode_equals_its_row_of_the_whole_prefill_alone_or_in_a_crowd(world, full_prefill):
    for i, n in enumerate(LENS):
        for p in sorted({0, 7, 8, 15, 16, 63, 64, 65, 128, 299, n - 1} & set(range(n))):
            assert torch.equal(run(world.batch([(i, p, 1)]))[0], full_prefill[i][p]), (i, p)
    order = [3, 0, 5, 1, 4, 2]
    crowd = run(world.batch([(i, LENS[i] - 1, 1) for i in order]))
    for j, i in enumerate(order):
        assert torch.equal(crowd[j], full_prefill[i][LENS[i] - 1]), i


@pytest.mark.parametrize("cuts", [[0, 300], [0, 1, 300], [0, 64, 128, 300], [0, 17, 100, 101, 299, 300]])
def test_any_chunking_of_a_prompt_gives_the_same_rows(world, full_prefill, cuts):
    rows = [run(world.batch([(0, lo, hi - lo)])) for lo, hi in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(rows), full_prefill[0])


def test_token_by_token_decode_equals_recompute_after_preemption(world, full_prefill):
    i, n = 1, LENS[1]
    for p in range(n):
        others = [(j, min(LENS[j] - 1, p), 1) for j in (0, 4) if p % 3 == j % 3]
        assert torch.equal(run(world.batch([(i, p, 1)] + others))[0], full_prefill[i][p]), p
    assert torch.equal(run(world.batch([(i, 0, n)])), full_prefill[i])


def test_thread_count_does_not_change_bits(world, full_prefill):
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(run(world.batch([(0, 0, 300)])), full_prefill[0]), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_steps_give_every_row_its_prefill_bits(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    group, kv_heads = [1, 3, 4, 5][seed % 4], 1 + seed % 3
    block_size, head_dim = [16, 4, 48][seed % 3], [64, 32, 8][seed % 3]
    lens = [rand(1, 400) for _ in range(7)]
    world = World(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=block_size, seed=seed)
    prefill = [run(world.batch([(i, 0, n)])) for i, n in enumerate(lens)]
    mixed = 0
    for _ in range(12):
        items = []
        for i in torch.randperm(len(lens), generator=gen).tolist()[: rand(1, len(lens) + 1)]:
            pos = rand(0, lens[i])
            items.append((i, pos, 1 if rand(0, 2) else rand(1, lens[i] - pos + 1)))
        step = world.batch(items)
        out = run(step)
        for j, (i, s, n) in enumerate(items):
            assert torch.equal(out[step.rows_of(j)], prefill[i][s : s + n]), (seed, items, j)
        mixed += len({n == 1 for _, _, n in items}) == 2
    assert mixed > 0  # decodes and chunks in one step happened


def test_the_kv_write_stores_what_torchs_does_and_refuses_a_slot_outside_the_cache():
    from pagoda.kernels import allocate_kv_cache, write_kv

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 5 * 64, generator=gen)  # k and v as strided views into a projection
    k, v = qkv[:, 64:192].view(6, 2, 64), qkv[:, 192:].view(6, 2, 64)[:, :2]
    slots = torch.tensor([5, 0, 17, 31, 8, 9])
    theirs, ours = allocate_kv_cache(4, 8, 2, 64, torch.float32, "cpu"), allocate_kv_cache(4, 8, 2, 64, torch.float32, "cpu")
    write_kv(*theirs, k, v, slots)
    cpu_native.write_kv(*ours, k, v, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_native.write_kv(*ours, k, v, torch.tensor([5, 0, 17, 32, 8, 9]))


def test_inputs_it_cannot_take_are_refused_by_name():
    world = World([10], num_heads=2, num_kv_heads=1, head_dim=64)
    step = world.batch([(0, 0, 10)])
    meta = step.meta
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.paged_attention(step.q.double(), step.k_cache, step.v_cache, meta.block_tables,
                                   meta.query_start_loc, meta.seq_lens, step.scale)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_native.paged_attention(step.q, step.k_cache, step.v_cache, meta.block_tables[:, :0].contiguous(),
                                   meta.query_start_loc, meta.seq_lens, step.scale)
