"""Sliding-window attention and soft-capped scores in the CPU backends: against the reference on random
inputs, and bitwise batch invariance (torch.equal) with a window in the C++ kernel and the torch fold.

Every step's caches are NaN-poisoned outside what it may read, and with a window also before each
sequence's earliest window start (attention_world.py, `window=`): a backend that reads a key it must
not see gets NaN. The Triton kernels' cases: triton_interpret_cases.py (interpreter), test_triton_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels.cpu_plan as plan_mod
from pagoda.kernels import cpu_native
from pagoda.kernels.cpu_attention import CpuBackend
from pagoda.kernels.cpu_sdpa import SdpaBackend
from pagoda.kernels.reference import reference_attention

from .attention_world import World, rel_err

SMALL_CHUNK = 128  # the fold's key chunk, so that windows start inside, at and past chunk boundaries
LENS = [300, 161, 64, 65, 7, 129]
# a chunk after a cached prefix, decodes at block and tile edges, a chunk at an odd offset, a whole prompt
ITEMS = [(0, 100, 150), (1, 160, 1), (2, 10, 54), (3, 64, 1), (4, 0, 7), (5, 128, 1)]
# W = 1, inside a block, one block, across tiles, past a fold chunk, wider than every context
WINDOWS = [1, 5, 16, 40, 130, 1000]
SOFTCAP = 1.5  # scores here are about N(0, 1): a cap this low bends them visibly
NATIVE = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")
BACKENDS = [pytest.param("native", marks=NATIVE), "fold", "sdpa"]


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "CHUNK", SMALL_CHUNK)
        yield


def make(name: str):
    if name == "native":
        backend = CpuBackend()
        assert backend.native
        return backend
    return CpuBackend(native=False) if name == "fold" else SdpaBackend()


def run(backend, step, window=0, softcap=0.0):
    out = backend.attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                            sliding_window=window, softcap=softcap)
    assert torch.isfinite(out).all(), "a row read a poisoned slot"
    return out


def reference(step, window=0, softcap=0.0):
    return reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                               sliding_window=window, softcap=softcap)


@pytest.fixture(scope="module")
def world():
    return World(LENS, num_heads=9, num_kv_heads=3, head_dim=64, seed=42)


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", BACKENDS)
def test_a_mixed_step_matches_the_reference(world, name, window, softcap):
    step = world.batch(ITEMS, window=window)
    out = run(make(name), step, window, softcap)
    assert rel_err(out, reference(step, window, softcap)) < 2e-6


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", BACKENDS)
def test_random_geometries_match_the_reference(name, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    group, kv_heads = [1, 4, 8][seed], [2, 1, 2][seed]
    block_size, head_dim = [16, 48, 4][seed], [64, 32, 128][seed]
    lens = [rand(1, 400) for _ in range(5)]
    world = World(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=block_size, seed=seed)
    items = []
    for i, n in enumerate(lens):
        pos = rand(0, n)
        items.append((i, pos, 1 if i % 2 else n - pos))
    window, softcap = rand(1, 200), [0.0, SOFTCAP, 30.0][seed]
    step = world.batch(items, window=window)
    assert rel_err(run(make(name), step, window, softcap), reference(step, window, softcap)) < 2e-6


def test_the_reference_is_what_transformers_computes():
    # mask kv > q - W and kv <= q, scores c * tanh(s / c), written out densely for one sequence
    world = World([70], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=3)
    step = world.batch([(0, 0, 70)])
    out = reference(step, 9, 2.0)
    q = world.q[0].double().transpose(0, 1)  # [H, T, D]
    k = world.k[0].double().repeat_interleave(2, 1).transpose(0, 1)
    v = world.v[0].double().repeat_interleave(2, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * world.scale
    scores = 2.0 * torch.tanh(scores / 2.0)
    i, j = torch.arange(70)[:, None], torch.arange(70)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - 9)), float("-inf"))
    assert rel_err(out, (scores.softmax(-1) @ v).transpose(0, 1)) < 1e-7  # out is float32


def test_window_and_softcap_change_the_result(world):
    step = world.batch(ITEMS)
    plain = reference(step)
    assert rel_err(reference(step, 40), plain) > 1e-2
    assert rel_err(reference(step, 0, SOFTCAP), plain) > 1e-2
    assert torch.equal(reference(step, 1000), plain)  # a window wider than every context is no window
    # W = 1: each token sees only itself, its own value row
    assert torch.equal(reference(step, 1)[step.rows_of(1)], world.v[1][160].repeat_interleave(3, 0)[None])


# ---------------------------------------------------------------- bitwise batch invariance


INVARIANT = [pytest.param("native", marks=NATIVE), "fold"]


@pytest.mark.parametrize("window,softcap", [(40, 0.0), (130, SOFTCAP), (1, 0.0)])
@pytest.mark.parametrize("name", INVARIANT)
def test_rows_alone_beside_others_and_inside_a_longer_chunk_give_the_same_bits(world, name, window, softcap):
    backend = make(name)
    prefill = [run(backend, world.batch([(i, 0, n)]), window, softcap) for i, n in enumerate(LENS)]
    # a decode alone equals its row of the whole-prompt prefill, at positions around blocks, tiles, chunks
    for p in (0, 5, 39, 40, 41, 63, 64, 127, 128, 129, 168, 169, 255, 256, 299):
        alone = run(backend, world.batch([(0, p, 1)], window=window), window, softcap)
        assert torch.equal(alone[0], prefill[0][p]), p
    # every sequence's last token decoded in a crowd, in another order
    order = [3, 0, 5, 1, 4, 2]
    crowd = run(backend, world.batch([(i, LENS[i] - 1, 1) for i in order], window=window), window, softcap)
    for j, i in enumerate(order):
        assert torch.equal(crowd[j], prefill[i][LENS[i] - 1]), i
    # chunks at other offsets, each recomputed inside a step with other sequences
    for cuts in ([0, 1, 300], [0, 17, 100, 101, 299, 300], [0, 170, 300]):
        rows = []
        for lo, hi in zip(cuts, cuts[1:]):
            step = world.batch([(2, 63, 1), (0, lo, hi - lo), (5, 0, 129)], window=window)
            out = run(backend, step, window, softcap)
            rows.append(out[step.rows_of(1)])
            assert torch.equal(out[step.rows_of(0)], prefill[2][63:64])
            assert torch.equal(out[step.rows_of(2)], prefill[5])
        assert torch.equal(torch.cat(rows), prefill[0]), cuts
    # the mixed step
    step = world.batch(ITEMS, window=window)
    out = run(backend, step, window, softcap)
    for j, (i, s, n) in enumerate(ITEMS):
        assert torch.equal(out[step.rows_of(j)], prefill[i][s : s + n]), i


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", INVARIANT)
def test_random_mixed_steps_give_every_row_its_prefill_bits(name, seed):
    gen = torch.Generator().manual_seed(300 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    group, kv_heads = [1, 3, 4][seed], [2, 1, 2][seed]
    block_size, head_dim = [16, 4, 48][seed], [64, 32, 8][seed]
    window, softcap = [7, 64, 150][seed], [SOFTCAP, 0.0, 5.0][seed]
    lens = [rand(1, 3 * SMALL_CHUNK) for _ in range(6)]
    world = World(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_size=block_size, seed=seed)
    backend = make(name)
    prefill = [run(backend, world.batch([(i, 0, n)]), window, softcap) for i, n in enumerate(lens)]
    mixed = 0
    for _ in range(8):
        items = []
        for i in torch.randperm(len(lens), generator=gen).tolist()[: rand(1, len(lens) + 1)]:
            pos = rand(0, lens[i])
            items.append((i, pos, 1 if rand(0, 2) else rand(1, lens[i] - pos + 1)))
        step = world.batch(items, window=window)
        out = run(backend, step, window, softcap)
        for j, (i, s, n) in enumerate(items):
            assert torch.equal(out[step.rows_of(j)], prefill[i][s : s + n]), (seed, items, j)
        mixed += len({n == 1 for _, _, n in items}) == 2
    assert mixed > 0


@pytest.mark.parametrize("name", INVARIANT)
def test_a_window_wider_than_the_context_is_bitwise_no_window(world, name):
    backend = make(name)
    for items in (ITEMS, [(i, n - 1, 1) for i, n in enumerate(LENS)], [(0, 0, 300)]):
        step = world.batch(items)
        assert torch.equal(run(backend, step, 300), run(backend, step)), items


def test_the_folds_group_and_step_sizes_never_change_bits_with_a_window(world, monkeypatch):
    # budgets so small that every decode is its own group and a prompt is folded 4 rows at a time, each
    # step starting at its own first chunk
    window = 40
    whole = run(CpuBackend(native=False), world.batch([(0, 0, 300)]), window, SOFTCAP)
    decodes = [(i, n - 1, 1) for i, n in enumerate(LENS)]
    crowd = run(CpuBackend(native=False), world.batch(decodes, window=window), window, SOFTCAP)
    monkeypatch.setattr(plan_mod, "SCORE_BUDGET", 1024)
    step = world.batch([(0, 0, 300)])
    plan = plan_mod.AttentionPlan.build(step.meta, world.block_size, 3, 3, 64, window)
    assert plan.row_sets[0].step == 4 and len(set(plan.row_sets[0].first_key)) > 3
    assert torch.equal(run(CpuBackend(native=False), step, window, SOFTCAP), whole)
    assert torch.equal(run(CpuBackend(native=False), world.batch(decodes, window=window), window, SOFTCAP), crowd)


def test_thread_count_does_not_change_bits_with_a_window(world):
    threads = torch.get_num_threads()
    outs = []
    try:
        for name in ("fold", "native") if cpu_native.available() else ("fold",):
            for n in (1, max(4, threads)):
                torch.set_num_threads(n)
                outs.append((name, run(make(name), world.batch(ITEMS, window=40), 40, SOFTCAP)))
    finally:
        torch.set_num_threads(threads)
    for name, out in outs:
        assert torch.equal(out, next(o for m, o in outs if m == name)), name


def test_the_fold_keeps_one_plan_per_window_within_a_step(world):
    # layers of one step may alternate sliding and full attention: each window's plan is built once
    backend = CpuBackend(native=False)
    step = world.batch(ITEMS, window=40)
    local = run(backend, step, 40)
    plan = backend.plan
    full = backend.attention(step.q, step.k_cache.nan_to_num(), step.v_cache.nan_to_num(), step.meta, step.scale)
    assert backend.plan is not plan
    assert torch.equal(run(backend, step, 40), local) and backend.plans[40] is plan
    assert torch.equal(full, CpuBackend(native=False).attention(step.q, step.k_cache.nan_to_num(),
                                                                step.v_cache.nan_to_num(), step.meta, step.scale))
    other = world.batch([(3, 64, 1)], window=40)
    run(backend, other, 40)
    assert list(backend.plans) == [40] and backend.plans[40].meta is other.meta  # a new step: fresh plans


def test_the_fold_skips_chunks_wholly_before_every_window(world):
    step = world.batch([(0, 299, 1)], window=40)
    plan = plan_mod.AttentionPlan.build(step.meta, world.block_size, 3, 3, 64, 40)
    assert [kc.start for rs in plan.row_sets for kc in rs.chunks] == [2 * SMALL_CHUNK]  # keys 260..299 only


@pytest.mark.parametrize("name", ["fold", "sdpa", pytest.param("native", marks=NATIVE)])
def test_negative_settings_are_refused(world, name):
    step = world.batch([(4, 0, 7)])
    with pytest.raises((ValueError, RuntimeError), match="sliding_window"):
        make(name).attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale, sliding_window=-1)
