"""The Triton kernels on a CUDA GPU in bfloat16 against the reference; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import select_backend
from pagoda.kernels.reference import reference_attention
from pagoda.kernels.triton_decode import SPLIT_SIZE

from .attention_world import World, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LONG = [1, 15, 16, 17, 63, 64, 65, SPLIT_SIZE, SPLIT_SIZE + 1, 2048, 8192]


def run(step, backend, window=0, softcap=0.0):
    out = backend.attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                            sliding_window=window, softcap=softcap)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_bf16_up_to_8k(group, head_dim):
    world = World(LONG, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16, seed=group)
    step = world.batch([(i, n - 1, 1) for i, n in enumerate(LONG)], device="cuda")
    out = run(step, select_backend("cuda"))
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_chunks_and_decodes_bf16(group, head_dim):
    lens = [8192, 3000, 600, 65, 17]
    world = World(lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16, seed=7)
    # a chunk after an 8k-1k cached prefix, a chunk at an odd offset, a whole prompt, two decodes
    step = world.batch([(0, 7168, 1024), (1, 1001, 1999), (2, 0, 600), (3, 64, 1), (4, 16, 1)], device="cuda")
    out = run(step, select_backend("cuda"))
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < 1e-2


def test_float32_is_exact_to_rounding():
    lens = [700, 33]
    world = World(lens, num_heads=12, num_kv_heads=4, head_dim=64, seed=3)
    backend = select_backend("cuda")
    for items in ([(0, 699, 1), (1, 32, 1)], [(0, 300, 400), (1, 0, 33)]):
        step = world.batch(items, device="cuda")
        ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
        assert rel_err(run(step, backend), ref) < 1e-5


def test_a_row_alone_equals_the_row_in_a_crowd():
    # each program's work depends only on its own sequence: no batch-shaped split or blocking
    lens = [5000, 1200, 90, 3]
    world = World(lens, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=11)
    backend = select_backend("cuda")
    crowd = run(world.batch([(i, n - 1, 1) for i, n in enumerate(lens)], device="cuda"), backend)
    for i, n in enumerate(lens):
        assert torch.equal(run(world.batch([(i, n - 1, 1)], device="cuda"), backend)[0], crowd[i])
    chunks = world.batch([(0, 4000, 1000), (1, 0, 1200), (2, 89, 1)], device="cuda")
    mixed = run(chunks, backend)
    alone = run(world.batch([(1, 0, 1200)], device="cuda"), backend)
    assert torch.equal(mixed[chunks.rows_of(1)], alone)


# ---------------------------------------------------------------- sliding windows and soft-capping
# (caches NaN-poisoned before each sequence's earliest window start too: attention_world.py)

MIXED = [(0, 7168, 1024), (1, 1001, 1999), (2, 0, 600), (3, 64, 1), (4, 16, 1)]


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (100, 0.0), (4096, 0.0), (0, 2.0), (512, 2.0), (20000, 0.0)])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_and_softcap_bf16(group, window, softcap):
    lens = [8192, 3000, 600, 65, 17]
    world = World(lens, num_heads=2 * group, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, seed=13)
    backend = select_backend("cuda")
    for items in ([(i, n - 1, 1) for i, n in enumerate(lens)], MIXED):  # split-K decode, then prefill
        step = world.batch(items, device="cuda", window=window)
        out = run(step, backend, window, softcap)
        ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                                  sliding_window=window, softcap=softcap)
        assert rel_err(out, ref) < 1e-2, items


def test_sliding_window_and_softcap_float32_exact_to_rounding():
    world = World([700, 33], num_heads=12, num_kv_heads=4, head_dim=64, seed=3)
    backend = select_backend("cuda")
    for window, softcap in ((3, 0.0), (300, 2.0), (1000, 0.0)):
        for items in ([(0, 699, 1), (1, 32, 1)], [(0, 300, 400), (1, 0, 33)]):
            step = world.batch(items, device="cuda", window=window)
            ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale,
                                      sliding_window=window, softcap=softcap)
            assert rel_err(run(step, backend, window, softcap), ref) < 1e-5, (window, softcap, items)


def test_a_windowed_row_alone_equals_the_row_in_a_crowd():
    lens = [5000, 1200, 90, 3]
    world = World(lens, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=11)
    backend = select_backend("cuda")
    window, softcap = 700, 2.0
    crowd = run(world.batch([(i, n - 1, 1) for i, n in enumerate(lens)], device="cuda", window=window), backend,
                window, softcap)
    for i, n in enumerate(lens):
        alone = run(world.batch([(i, n - 1, 1)], device="cuda", window=window), backend, window, softcap)
        assert torch.equal(alone[0], crowd[i])
    chunks = world.batch([(0, 4000, 1000), (1, 0, 1200), (2, 89, 1)], device="cuda", window=window)
    mixed = run(chunks, backend, window, softcap)
    alone = run(world.batch([(1, 0, 1200)], device="cuda", window=window), backend, window, softcap)
    assert torch.equal(mixed[chunks.rows_of(1)], alone)


# ---------------------------------------------------------------- float16, block sizes, ragged batches


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,block_size", [(1, 16), (4, 16), (4, 32), (8, 48)])
def test_ragged_decode_and_mixed_steps_by_dtype_and_block_size(dtype, group, block_size):
    # a ragged batch: contexts from 1 to past two splits, chunks at odd offsets beside decodes
    lens = [1, 33, SPLIT_SIZE + 7, 2 * SPLIT_SIZE + 100, 700, 64]
    world = World(lens, num_heads=2 * group, num_kv_heads=2, head_dim=128, block_size=block_size, dtype=dtype,
                  seed=group + block_size)
    backend = select_backend("cuda")
    for items in ([(i, n - 1, 1) for i, n in enumerate(lens)],
                  [(0, 0, 1), (1, 5, 28), (2, SPLIT_SIZE + 6, 1), (3, 200, 900), (4, 0, 700), (5, 63, 1)]):
        step = world.batch(items, device="cuda")
        ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
        assert rel_err(run(step, backend), ref) < 1e-2, items


# ---------------------------------------------------------------- the batch-invariant mode


def test_invariant_backend_gives_a_decode_the_same_bits_beside_prefills_and_in_any_chunking():
    lens = [3000, 700, 90]
    world = World(lens, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=17)
    invariant, plain = select_backend("cuda", batch_invariant=True), select_backend("cuda")
    assert invariant.name == "triton_invariant"
    alone = run(world.batch([(0, 2999, 1)], device="cuda"), invariant)[0]
    step = world.batch([(1, 100, 600), (0, 2999, 1), (2, 0, 90)], device="cuda")  # the decode beside two chunks
    assert torch.equal(run(step, invariant)[step.rows_of(1)][0], alone)
    # the last token of the same sequence computed inside a chunk of 900 (a recompute) has the same bits too
    chunk = world.batch([(0, 2100, 900)], device="cuda")
    assert torch.equal(run(chunk, invariant)[-1], alone)
    ref = reference_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(run(step, invariant), ref) < 1e-2 and rel_err(run(step, plain), ref) < 1e-2


@pytest.mark.parametrize("out_features,in_features,bias", [(4096, 4096, False), (1000, 300, True), (6144, 2048, False)])
def test_triton_matmul_rows_are_batch_invariant_in_bf16(out_features, in_features, bias):
    from pagoda.kernels.triton_matmul import config_for, linear

    gen = torch.Generator(device="cuda").manual_seed(out_features)
    w = (torch.randn(out_features, in_features, generator=gen, device="cuda") * in_features**-0.5).bfloat16()
    b = torch.randn(out_features, generator=gen, device="cuda").bfloat16() if bias else None
    x = torch.randn(300, in_features, generator=gen, device="cuda").bfloat16()
    full = linear(x, w, b)
    assert rel_err(full, torch.nn.functional.linear(x, w, b)) < 1e-2
    for rows in (1, 2, 7, 64, 65, 129):
        for start in (0, 5, 300 - rows):
            assert torch.equal(linear(x[start : start + rows], w, b), full[start : start + rows]), (rows, start)
    assert config_for(out_features, in_features, torch.bfloat16) == config_for(out_features, in_features, w.dtype)


def test_invariant_kernels_end_to_end_on_a_tiny_model():
    # a prompt alone against the same prompt among 15 others, its prefill chunked beside decodes: tokens and
    # every sampled logits row bitwise equal (the GPU script runs the same at real shapes, in a crowd of 64)
    from pagoda.bench.gpu_invariance import engine_check
    from pagoda.bench.offline import invariant_kernels
    from pagoda.model.config import named_config
    from pagoda.model.llama import build_model

    matmul, backend = invariant_kernels(torch.device("cuda"), torch.bfloat16)
    config = named_config("tiny")
    model = build_model(config, dtype=torch.bfloat16, device="cuda", max_positions=1024, matmul=matmul)
    model.init_random_weights(seed=0, std=0.5)
    check = engine_check(model, config.vocab_size, backend, prompt_len=200, crowd=16, max_tokens=12, budget=128,
                         seed=0)
    assert check["ok"], check
