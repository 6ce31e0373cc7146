"""The Llama decoder: paged forward vs the dense reference, and per-op batch invariance."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.config import named_config
from pagoda.model.llama import StepContext, apply_rope, build_model, rope_inv_freq, rope_tables
from pagoda.model.invariance import prove_row_invariance
from pagoda.model.matmul import (INT4, INT8, INT8_AVX2, MKL_PADDED, ONEDNN, ONEDNN_BF16, ONEDNN_PACKED, PLAIN, PackedWeight,
                                 has_onednn_bf16, select_matmul)
from pagoda.model.quantize import has_int_kernels
from pagoda.kernels import AttentionMetadata, allocate_kv_cache, cpu_native, select_backend

BLOCK_SIZE = 4


def tiny_model(seed=0, **overrides):
    model = build_model(named_config("tiny", **overrides), max_positions=256)
    model.init_random_weights(seed=seed, std=0.1)
    return model


def empty_caches(model, num_blocks=64):
    c = model.config
    shape = (num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
    return [allocate_kv_cache(*shape) for _ in range(c.num_hidden_layers)]


def paged_step(model, caches, seqs, pad_to=None):
    """One flat forward over seqs = [(token_ids, start, block_table)]; returns logits of every new token."""
    ids = [t for toks, _, _ in seqs for t in toks]
    pos = [p for toks, start, _ in seqs for p in range(start, start + len(toks))]
    meta = AttentionMetadata.build(
        [len(t) for t, _, _ in seqs], [s + len(t) for t, s, _ in seqs], [bt for _, _, bt in seqs], BLOCK_SIZE
    )
    n = len(ids)
    pad_to = pad_to or model.matmul.row_multiple
    padded = -(-n // pad_to) * pad_to
    ctx = StepContext(meta=meta, kv_caches=caches, backend=select_backend("cpu", "reference"), num_tokens=n)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids + [0] * (padded - n)), torch.tensor(pos + [0] * (padded - n)), ctx)
        return model.compute_logits(hidden[:n])


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_word_embeddings": False}], ids=["llama", "qwen2-bias"])
def test_paged_prefill_matches_dense_forward(overrides):
    model = tiny_model(**overrides)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        dense = model.reference_forward(torch.tensor(prompt))  # [T, V]
    paged = paged_step(model, empty_caches(model), [(prompt, 0, list(range(10, 20)))], pad_to=4)
    assert paged.shape == dense.shape == (37, model.config.vocab_size)
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)
    assert dense.std() > 0.1  # the weights are not so small that every logit is the same


def test_decode_one_token_at_a_time_matches_dense_forward():
    model = tiny_model(seed=3)
    tokens = torch.randint(0, model.config.vocab_size, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        dense = model.reference_forward(torch.tensor(tokens))
    caches = empty_caches(model)
    table = [7, 3, 12, 5, 9, 1, 30]  # scattered, out-of-order blocks
    rows = [paged_step(model, caches, [(tokens[:10], 0, table)])]
    for p in range(10, 25):
        rows.append(paged_step(model, caches, [(tokens[p : p + 1], p, table)], pad_to=4))
    torch.testing.assert_close(torch.cat(rows), dense, rtol=1e-4, atol=1e-4)


def test_gqa_heads_read_their_own_kv_head():
    # With one KV head per query head the model is plain MHA; GQA must differ from it.
    mha = tiny_model(num_key_value_heads=4)
    gqa = tiny_model(num_key_value_heads=2)
    prompt = list(range(3, 20))
    for model in (mha, gqa):
        paged = paged_step(model, empty_caches(model), [(prompt, 0, list(range(5)))])
        with torch.inference_mode():
            torch.testing.assert_close(paged, model.reference_forward(torch.tensor(prompt)), rtol=1e-4, atol=1e-4)


def test_rope_rotates_pairs_half_apart():
    config = named_config("tiny")
    cos, sin = rope_tables(config, 8)
    x = torch.randn(8, 1, config.head_dim)
    out = apply_rope(x, cos, sin)
    half = config.head_dim // 2
    theta = torch.arange(8)[:, None] * rope_inv_freq(config)[None, :]  # [8, D/2]
    x1, x2 = x[:, 0, :half], x[:, 0, half:]
    torch.testing.assert_close(out[:, 0, :half], x1 * theta.cos() - x2 * theta.sin())
    torch.testing.assert_close(out[:, 0, half:], x2 * theta.cos() + x1 * theta.sin())
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_llama3_scaling_slows_only_long_wavelengths():
    base = named_config("tiny", rope_theta=500000.0)
    scaled = named_config("llama-3.2-1b")
    assert scaled.rope_scaling is not None
    plain = rope_inv_freq(named_config("llama-3.2-1b", rope_scaling=None))
    stretched = rope_inv_freq(scaled)
    assert torch.equal(stretched[:4], plain[:4])  # short wavelengths untouched
    torch.testing.assert_close(stretched[-4:], plain[-4:] / scaled.rope_scaling.factor)
    assert base.rope_scaling is None


# -- batch invariance, op by op ------------------------------------------------
SIZES = list(range(1, 65)) + [100, 257, 1024]
SAMPLE_SIZES = list(range(1, 18)) + [33, 64]  # rows reaching the LM head: one per sampling sequence
HAS_ONEDNN = select_matmul("cpu") in (ONEDNN, ONEDNN_PACKED)
CPU_KERNELS = [k for k in (ONEDNN_PACKED, ONEDNN, MKL_PADDED) if k is MKL_PADDED or HAS_ONEDNN]
CPU_KERNELS += [ONEDNN_BF16] if has_onednn_bf16() else []
CPU_KERNELS += [INT8, INT4] if has_int_kernels() else []  # row_multiple 1: invariant with no padding at all
CPU_KERNELS += [INT8_AVX2] if cpu_native.available() else []


def _padded(fn, x, multiple):
    """Apply fn to x padded with zero rows to a multiple of `multiple`, as the runner does."""
    n = x.shape[0]
    pad = -(-n // multiple) * multiple - n
    return fn(torch.cat((x, x.new_zeros(pad, *x.shape[1:]))))[:n]


def _row_is_invariant(fn, width, multiple, sizes=SIZES, seed=0):
    """The probe row gets the same bits at every batch size and position (with padding)."""
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(1, width, generator=gen)
    crowd = torch.randn(max(sizes), width, generator=gen)
    want = _padded(fn, probe, multiple)[0]
    for n in sizes:
        for at in {0, n // 2, n - 1}:
            x = crowd[:n].clone()
            x[at] = probe[0]
            if not torch.equal(_padded(fn, x, multiple)[at], want):
                return False, (n, at)
    return True, None


def test_cpu_float32_default_is_a_batch_invariant_kernel():
    assert select_matmul("cpu").row_multiple > 1
    bf16 = select_matmul("cpu", torch.bfloat16)  # bfloat16 weights only where oneDNN multiplies them natively
    assert bf16 is (ONEDNN_BF16 if has_onednn_bf16() else PLAIN)
    assert select_matmul("cpu", torch.float16) is PLAIN  # no invariance claimed for float16


def test_cpu_bfloat16_model_keeps_float32_activations_and_frees_plain_weights():
    model = build_model(named_config("tiny"), max_positions=64, dtype=torch.bfloat16)
    if model.matmul is not ONEDNN_BF16:
        pytest.skip("no native bfloat16 products on this CPU")
    assert next(model.parameters()).dtype == torch.float32
    model.init_random_weights(seed=0)
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(4, lin.in_features)
    want = x.to(torch.bfloat16).float() @ lin.weight.to(torch.bfloat16).float().T
    before = model.matmul_bytes()
    model.pack_weights(release=True)
    assert lin.weight.numel() == 0 and model.matmul_bytes() < before  # the bf16 pack is the only copy
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), want, rtol=8e-3, atol=1e-4)  # oneDNN rounds its output to bf16
    with pytest.raises(RuntimeError, match="released"):
        model.init_random_weights(seed=1)


@pytest.mark.parametrize("matmul", CPU_KERNELS, ids=lambda k: k.name)
def test_each_op_is_batch_invariant_with_row_padding(matmul):
    model = build_model(named_config("smollm2-135m", num_hidden_layers=1), max_positions=64, matmul=matmul)
    model.init_random_weights(seed=0)
    model.pack_weights()  # as the runner does (a no-op for kernels without a weight layout of their own)
    prove_row_invariance(model.packs())  # and caps each product's calls at the rows proven on this machine
    layer = model.model.layers[0]
    h, d = model.config.hidden_size, model.config.head_dim
    cos, sin = model.rope_cos[17:18], model.rope_sin[17:18]
    ops = {
        "rmsnorm": (layer.input_layernorm, h, SIZES),
        "qkv_proj": (layer.self_attn.qkv_proj, h, SIZES),
        "rope": (lambda x: apply_rope(x.view(x.shape[0], -1, d), cos.expand(x.shape[0], d), sin.expand(x.shape[0], d)).flatten(1), 4 * d, SIZES),
        "o_proj": (layer.self_attn.o_proj, model.config.q_size, SIZES),
        "mlp": (layer.mlp, h, SIZES),
        "lm_head": (model.compute_logits, h, SAMPLE_SIZES),
    }
    with torch.inference_mode():
        for name, (fn, width, sizes) in ops.items():
            ok, where = _row_is_invariant(fn, width, matmul.row_multiple, sizes)
            assert ok, f"{name}: row differs at (batch size, position) {where}"


@pytest.mark.parametrize("matmul", [k for k in CPU_KERNELS if k in (INT8, INT4, INT8_AVX2)], ids=lambda k: k.name)
def test_a_float_lm_head_over_int_layers_keeps_its_own_padding(matmul):
    """int layers with a bfloat16 (or float32) LM head: the runner pads to the head's row multiple."""
    from pagoda.model.factory import make_engine
    from pagoda.core.engine_config import EngineConfig

    model = build_model(named_config("smollm2-135m", num_hidden_layers=1), max_positions=64, matmul=matmul)
    head = ONEDNN_BF16 if has_onednn_bf16() else select_matmul("cpu")
    model.lm_head_packed = PackedWeight(head)
    model.init_random_weights(seed=0)
    engine = make_engine(model, EngineConfig(num_blocks=8, block_size=4, max_model_len=32))
    assert engine.runner.row_multiple == max(matmul.row_multiple, head.row_multiple)
    with torch.inference_mode():
        ok, where = _row_is_invariant(model.compute_logits, model.config.hidden_size, engine.runner.row_multiple,
                                      SAMPLE_SIZES)
    assert ok, f"lm_head: row differs at (batch size, position) {where}"


@pytest.mark.parametrize("matmul", [k for k in CPU_KERNELS if k.row_multiple > 1], ids=lambda k: k.name)
def test_without_padding_the_kernel_is_not_batch_invariant(matmul):
    """Why the runner pads: shows the hazard on this machine (skipped where the BLAS has none)."""
    w = torch.randn(1536, 576)
    x = torch.randn(8, 576)
    together = matmul.linear(x, w, None)
    differs = [i for i in range(8) if not torch.equal(matmul.linear(x[i : i + 1], w, None)[0], together[i])]
    if not differs:
        pytest.skip(f"{matmul.name} gives a lone row the same bits as a row in a batch here")
    packed = PackedWeight(matmul)
    packed.pack(w)
    prove_row_invariance([(packed, w)])  # padding, and calls no bigger than this machine proved, remove it
    assert _row_is_invariant(lambda t: packed.product(t, w, None), 576, matmul.row_multiple)[0]


@pytest.mark.skipif(not HAS_ONEDNN, reason="oneDNN matmul unavailable")
def test_packed_weights_are_used_and_follow_in_place_changes():
    model = build_model(named_config("tiny"), max_positions=64, matmul=ONEDNN_PACKED)
    model.init_random_weights(seed=0)
    lin = model.model.layers[0].mlp.down_proj
    assert lin.packed.packed is None  # nothing packed until asked: weights may still be loading
    model.pack_weights()
    assert lin.packed.packed is not None and lin.packed.packed.is_mkldnn and model.lm_head_packed.packed is not None
    x = torch.randn(4, lin.in_features)
    with torch.inference_mode():
        before = lin(x)
        torch.testing.assert_close(before, x @ lin.weight.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lin.weight.mul_(2)  # bumps the version counter: the stale pack is redone
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), 2 * before, rtol=1e-5, atol=1e-5)
    model.init_random_weights(seed=1)  # writes through .data: drops every pack
    assert lin.packed.packed is None and model.lm_head_packed.packed is None
