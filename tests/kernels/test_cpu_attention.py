"""The CPU backend's torch fold against the reference, and its bitwise batch invariance (torch.equal, not
closeness). The C++ kernel the backend runs in float32 where it builds: test_cpu_native_attention.py."""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels.cpu_attention as cpu_mod
import pagoda.kernels.cpu_plan as plan_mod
from pagoda.kernels.cpu_attention import CpuBackend, cpu_attention
from pagoda.kernels.cpu_plan import TILE
from pagoda.kernels.reference import reference_attention

from .attention_world import World, rel_err

# lengths at and around block (16) and tile (64) boundaries
BOUNDARY_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129]


def run_cpu(step, backend=None):
    """Run the CPU backend with a NaN-poisoned output, so a row it never writes is caught."""
    out = torch.full_like(step.q, float("nan"))
    ws = backend.workspace if backend else None
    cpu_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale, ws, out=out)
    assert torch.isfinite(out).all(), "a row was left unwritten or read a poisoned slot"
    return out


def check_close(step, out, tol=2e-6):
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < tol
    assert (out.double() - ref.double()).abs().max().item() < 20 * tol


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_full_prefill_matches_reference(group, head_dim):
    world = World(BOUNDARY_LENS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, seed=group)
    step = world.batch([(i, 0, n) for i, n in enumerate(BOUNDARY_LENS)])
    check_close(step, run_cpu(step))


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decodes_match_reference(group):
    world = World(BOUNDARY_LENS, num_heads=group, num_kv_heads=1, head_dim=64, seed=10 + group)
    step = world.batch([(i, n - 1, 1) for i, n in enumerate(BOUNDARY_LENS)])
    check_close(step, run_cpu(step))


def test_chunked_prefill_with_cached_prefix_and_decodes_in_one_batch():
    lens = [200, 150, 90, 70, 33]
    world = World(lens, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    # chunks at offsets inside and on tile/block boundaries, plus decodes, in one step
    items = [(0, 64, 100), (1, 17, 133), (2, 89, 1), (3, 69, 1), (4, 0, 33)]
    step = world.batch(items)
    check_close(step, run_cpu(step))


@pytest.mark.parametrize(
    "block_size,head_dim", [(1, 64), (48, 64), (128, 64), (16, 8), (16, 80)], ids=str
)
def test_unusual_block_sizes_and_head_dims(block_size, head_dim):
    lens = [5, 130, 47, 200]
    world = World(lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=block_size, seed=4)
    step = world.batch([(0, 0, 5), (1, 100, 30), (2, 46, 1), (3, 199, 1)])
    check_close(step, run_cpu(step))


def test_bfloat16_close_to_reference_and_still_invariant():
    world = World([150, 40], num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=5)
    chunk = world.batch([(0, 0, 150), (1, 0, 40)])
    out = run_cpu(chunk)
    ref = reference_attention(chunk.q, chunk.k_cache, chunk.v_cache, chunk.meta, chunk.scale)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    decode = world.batch([(0, 149, 1)])
    assert torch.equal(run_cpu(decode)[0], out[149])


def test_empty_batch():
    world = World([4], num_heads=2, num_kv_heads=1, head_dim=64)
    step = world.batch([(0, 0, 4)])
    meta = type(step.meta).build([], [], [], 16)
    out = CpuBackend().attention(step.q[:0], step.k_cache, step.v_cache, meta, 0.1)
    assert out.shape == (0, 2, 64)


# ---------------------------------------------------------------- bitwise batch invariance

LENS = [300, 161, 64, 65, 7, 129]
SMALL_CHUNK = 128  # so that these contexts span up to three key chunks of the online softmax


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "CHUNK", SMALL_CHUNK)
        yield


@pytest.fixture(scope="module")
def world():
    return World(LENS, num_heads=9, num_kv_heads=3, head_dim=64, seed=42)


@pytest.fixture(scope="module")
def full_prefill(world):
    """Every row of every sequence, computed as one whole-prompt prefill per sequence, alone."""
    return [run_cpu(world.batch([(i, 0, n)])) for i, n in enumerate(LENS)]


def test_decode_equals_row_of_whole_prefill(world, full_prefill):
    positions = [0, 15, 16, 63, 64, 65, 128, 299]
    checked = 0
    for i, n in enumerate(LENS):
        for p in [p for p in positions if p < n] + [n - 1]:
            out = run_cpu(world.batch([(i, p, 1)]))
            assert torch.equal(out[0], full_prefill[i][p]), (i, p)
            checked += 1
    assert checked > 25


def test_decode_alone_equals_decode_in_a_crowd(world, full_prefill):
    # the crowd pads keys to the longest context (300 -> 5 tiles) while a short row alone has 1 tile
    alone = [run_cpu(world.batch([(i, n - 1, 1)]))[0] for i, n in enumerate(LENS)]
    crowd = run_cpu(world.batch([(i, n - 1, 1) for i, n in enumerate(LENS)]))
    assert -(-max(LENS) // TILE) > -(-min(LENS) // TILE)
    for i in range(len(LENS)):
        assert torch.equal(crowd[i], alone[i]), i
        assert torch.equal(crowd[i], full_prefill[i][LENS[i] - 1]), i
    # and whatever the order of the sequences in the batch
    order = [3, 0, 5, 1, 4, 2]
    shuffled = run_cpu(world.batch([(i, LENS[i] - 1, 1) for i in order]))
    for j, i in enumerate(order):
        assert torch.equal(shuffled[j], alone[i])


@pytest.mark.parametrize("cuts", [[0, 300], [0, 1, 300], [0, 64, 128, 300], [0, 17, 100, 101, 299, 300], [0, 250, 300]])
def test_any_chunking_of_a_prompt_gives_the_same_rows(world, full_prefill, cuts):
    rows = []
    for lo, hi in zip(cuts, cuts[1:]):
        rows.append(run_cpu(world.batch([(0, lo, hi - lo)])))
    assert torch.equal(torch.cat(rows), full_prefill[0])


def test_token_by_token_decode_equals_recompute_after_preemption(world, full_prefill):
    # sequence 1 decoded one token at a time in a changing crowd, then recomputed in one chunk
    i, n = 1, LENS[1]
    for p in range(n):
        others = [(j, min(LENS[j] - 1, p), 1) for j in (0, 4) if j != i and p % 3 == j % 3]
        step = world.batch([(i, p, 1)] + others)
        assert torch.equal(run_cpu(step)[0], full_prefill[i][p]), p
    recompute = run_cpu(world.batch([(i, 0, n)]))
    assert torch.equal(recompute, full_prefill[i])


def test_mixed_batch_rows_equal_their_alone_rows(world, full_prefill):
    items = [(0, 100, 150), (1, 160, 1), (2, 10, 54), (3, 64, 1), (4, 0, 7), (5, 128, 1)]
    out = run_cpu(world.batch(items))
    step = world.batch(items)
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(out[step.rows_of(j)], full_prefill[i][s : s + n]), i


def test_grouping_and_step_sizes_never_change_bits(world, full_prefill, monkeypatch):
    items = [(i, n - 1, 1) for i, n in enumerate(LENS)]
    ref_decodes = run_cpu(world.batch(items))
    assert len(plan_mod._decode_groups(list(range(len(LENS))), LENS, SMALL_CHUNK, 1 << 20)) == 1
    # budgets so small that every decode is its own group and a prompt is folded 4 rows at a time
    monkeypatch.setattr(plan_mod, "SCORE_BUDGET", 1024)
    assert len(plan_mod._decode_groups(list(range(len(LENS))), LENS, SMALL_CHUNK, 1024 // 12)) == len(LENS)
    assert torch.equal(run_cpu(world.batch(items)), ref_decodes)
    assert torch.equal(run_cpu(world.batch([(0, 0, 300)])), full_prefill[0])


def test_chunk_size_is_a_real_parameter(world, full_prefill, monkeypatch):
    # a different key chunk gives (slightly) different bits: the invariance above is not vacuous,
    # and the chunk size must stay fixed for the life of an engine
    monkeypatch.setattr(plan_mod, "CHUNK", 4 * SMALL_CHUNK)
    other = run_cpu(world.batch([(0, 0, 300)]))
    assert not torch.equal(other, full_prefill[0])
    assert rel_err(other, full_prefill[0]) < 1e-6


def test_row_padding_is_what_keeps_decodes_equal_to_prefill_rows(world, full_prefill, monkeypatch):
    # without padding a decode's 3 rows (G = 3) to 4, MKL takes its few-row path and the bits move
    monkeypatch.setattr(plan_mod, "ROW_MULTIPLE", 1)
    differ = sum(
        not torch.equal(run_cpu(world.batch([(0, p, 1)]))[0], full_prefill[0][p]) for p in range(0, 300, 10)
    )
    if differ == 0:  # an MKL that computes a few-row product as it does a 4-row one (seen on a Xeon with AMX)
        pytest.skip("MKL gives 3-row and 4-row products the same bits on this CPU: no hazard to show")
    assert differ > 0


def test_thread_count_does_not_change_bits(world, full_prefill):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_cpu(world.batch([(0, 0, 300)]))
        torch.set_num_threads(max(4, threads))
        many = run_cpu(world.batch([(0, 0, 300)]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full_prefill[0]) and torch.equal(many, full_prefill[0])


def test_backend_reuses_its_workspace_without_leaking_state(world, full_prefill):
    backend = CpuBackend(native=False)
    first = run_cpu(world.batch([(0, 0, 300)]), backend)
    grown = backend.workspace.nbytes
    run_cpu(world.batch([(i, n - 1, 1) for i, n in enumerate(LENS)]), backend)
    again = run_cpu(world.batch([(0, 0, 300)]), backend)
    assert grown > 0 and backend.workspace.nbytes >= grown
    assert torch.equal(first, again) and torch.equal(first, full_prefill[0])


def test_the_comparisons_above_catch_a_plain_vectorized_kernel(world, full_prefill):
    # the same decode-versus-prefill comparison fails for torch SDPA, which picks its blocking from
    # the shapes it is given: evidence that torch.equal here is a real test, not a formality
    from pagoda.kernels.cpu_sdpa import sdpa_attention

    prefill = sdpa_attention(*_args(world.batch([(0, 0, 300)])))
    differ = 0
    for p in range(0, 300, 7):
        decode = sdpa_attention(*_args(world.batch([(0, p, 1)])))
        differ += not torch.equal(decode[0], prefill[p])
    assert differ > 0


def _args(step):
    return step.q, step.k_cache, step.v_cache, step.meta, step.scale


def test_default_chunk_over_a_long_context(monkeypatch):
    monkeypatch.setattr(plan_mod, "CHUNK", 1024)
    n = 2 * 1024 + 70  # three default chunks
    world = World([n, 40], num_heads=4, num_kv_heads=1, head_dim=64, seed=12)
    whole = run_cpu(world.batch([(0, 0, n)]))
    check_close(world.batch([(0, 0, n)]), whole)
    for p in (1023, 1024, 2047, 2048, n - 1):
        assert torch.equal(run_cpu(world.batch([(0, p, 1), (1, 39, 1)]))[0], whole[p]), p
    tail = run_cpu(world.batch([(0, 1500, n - 1500)]))
    assert torch.equal(tail, whole[1500:])


# ---------------------------------------------------------------- the per-step plan and random batches


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_steps_give_every_row_its_prefill_bits(seed):
    # random geometry, lengths across several key chunks, and steps mixing decodes (alone, in
    # groups, at non-adjacent token offsets) with chunks at random offsets
    gen = torch.Generator().manual_seed(100 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    group, kv_heads = [1, 3, 4, 5][seed % 4], 1 + seed % 3
    block_size, head_dim = [16, 4, 48][seed % 3], [64, 32, 8][seed % 3]
    lens = [rand(1, 3 * SMALL_CHUNK) for _ in range(7)]
    world = World(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=block_size, seed=seed)
    prefill = [run_cpu(world.batch([(i, 0, n)])) for i, n in enumerate(lens)]
    seen = {"decode groups": 0, "scattered decodes": 0, "multi-chunk decodes": 0, "chunks": 0}
    for _ in range(12):
        items = []
        for i in torch.randperm(len(lens), generator=gen).tolist()[: rand(1, len(lens) + 1)]:
            pos = rand(0, lens[i])
            n = 1 if rand(0, 2) else rand(1, lens[i] - pos + 1)
            items.append((i, pos, n))
        step = world.batch(items)
        out = run_cpu(step)
        for j, (i, s, n) in enumerate(items):
            assert torch.equal(out[step.rows_of(j)], prefill[i][s : s + n]), (seed, items, j)
        decodes = [j for j, (_, _, n) in enumerate(items) if n == 1]
        seen["decode groups"] += len(decodes) > 1
        seen["scattered decodes"] += any(b - a > 1 for a, b in zip(decodes, decodes[1:]))
        seen["multi-chunk decodes"] += any(items[j][1] >= SMALL_CHUNK for j in decodes)
        seen["chunks"] += len(decodes) < len(items)
    assert all(seen.values()), seen  # every hard case happened


def test_backend_builds_one_plan_per_step_for_all_layers(world, full_prefill):
    backend = CpuBackend(native=False)
    items = [(0, 299, 1), (2, 10, 54), (1, 160, 1)]
    step = world.batch(items)
    layers = [backend.attention(step.q * (1 + layer), step.k_cache, step.v_cache, step.meta, step.scale)
              for layer in range(3)]
    plan = backend.plan
    assert plan is not None and plan.meta is step.meta and len(plan.row_sets) == 2  # the decodes, the chunk
    backend.attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert backend.plan is plan  # reused by a later layer of the same step
    for layer, got in enumerate(layers):
        want = cpu_attention(step.q * (1 + layer), step.k_cache, step.v_cache, step.meta, step.scale)
        assert torch.equal(got, want)
    for j, (i, s, n) in enumerate(items):
        assert torch.equal(layers[0][step.rows_of(j)], full_prefill[i][s : s + n])
    other = world.batch([(3, 64, 1)])
    backend.attention(other.q, other.k_cache, other.v_cache, other.meta, other.scale)
    assert backend.plan is not plan and backend.plan.meta is other.meta  # a new step, a new plan


def test_halving_sum_ignores_trailing_zero_entries():
    gen = torch.Generator().manual_seed(3)
    for count in range(1, 20):
        x = torch.randn(2, count, 5, generator=gen)
        want = cpu_mod._halving_sum_(x.clone(), 1)
        for padded in (count + 1, 16, 32):
            z = torch.cat((x, torch.zeros(2, max(0, padded - count), 5)), 1)
            assert torch.equal(cpu_mod._halving_sum_(z, 1), want), (count, padded)
