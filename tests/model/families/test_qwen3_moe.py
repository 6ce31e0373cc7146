"""Qwen3-MoE (top-k routed experts, a dense layer by mlp_only_layers) against transformers' Qwen3MoeForCausalLM,
its batch invariance, the sparse block's row invariance, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.architectures import parse_config
from pagoda.model.config import ModelConfigError
from pagoda.model.families.qwen3_moe import SparseMoeBlock
from pagoda.model.loader import load_model
from pagoda.model.invariance import prove_row_invariance
from pagoda.model.matmul import select_matmul
from pagoda.model.shard import ShardPlan
from tests.model.families.family_checks import check_batch_invariance, check_matches_transformers, save_random_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
             bos_token_id=1, eos_token_id=2)


def _hf(tmp_path, **overrides):
    return save_random_hf(tmp_path, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                          **{**SMALL, **overrides})


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_qwen3_moe_matches_transformers(tmp_path, norm):
    hf, d = _hf(tmp_path, norm_topk_prob=norm)
    model = check_matches_transformers(hf, d)
    c = model.config
    assert c.family == "qwen3_moe" and c.qk_norm and c.norm_topk_prob == norm
    assert c.num_experts == 8 and c.num_experts_per_tok == 2 and c.moe_layers == (0, 2)
    layers = model.model.layers
    assert [layer.sparse for layer in layers] == [True, False, True]
    assert layers[1].mlp.gate_up_proj.out_features == 2 * 96 and len(layers[2].mlp.experts) == 8
    # the experts' gate and up halves came from the checkpoint's gate_proj and up_proj (the engine released
    # the plain weights of `model` after packing them: a fresh load)
    fresh, _ = load_model(d, "float32", "cpu")
    for e in (0, 5, 7):
        theirs = hf.model.layers[2].mlp.experts  # gate_up_proj [E, 2I, H], gate rows then up rows
        assert torch.equal(fresh.model.layers[2].mlp.experts[e].gate_up_proj.weight, theirs.gate_up_proj[e])
        assert torch.equal(fresh.model.layers[2].mlp.experts[e].down_proj.weight, theirs.down_proj[e])
    assert torch.equal(fresh.model.layers[0].mlp.gate.weight, hf.model.layers[0].mlp.gate.weight)


def test_qwen3_moe_is_batch_invariant(tmp_path):
    _, d = _hf(tmp_path, std=0.1, norm_topk_prob=True)
    check_batch_invariance(d)


@pytest.mark.parametrize("kernel", [None, "mkl"], ids=["default", "mkl"])
def test_sparse_block_rows_are_the_same_alone_and_in_any_crowd(kernel):
    """The same rows through the block alone and inside batches of 1..64 other random rows: same routing, same bits.

    MKL sgemm takes another path for a remainder of 1-3 rows: there an expert that did not pad its rows to the
    kernel's multiple gives a row other bits in a crowd (measured: every crowd differed with the padding off)."""
    config = parse_config({**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16,
                           "num_experts_per_tok": 4, "norm_topk_prob": True, "hidden_size": 128})
    matmul = select_matmul("cpu", name=kernel)
    assert matmul.row_multiple > 1  # the padding per expert is exercised
    block = SparseMoeBlock(config, matmul).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    packs = [(m.packed, m.weight) for m in block.modules() if hasattr(m, "packed")]
    for packed, weight in packs:
        packed.pack(weight)
    prove_row_invariance(packs)  # as the runner does: calls capped at the rows this machine proved

    def step(rows):  # as the runner pads a step's rows (the padding rows route to no expert)
        pad = -len(rows) % matmul.row_multiple
        out = block(torch.cat((rows, torch.randn(pad, 128, generator=gen))), num_rows=len(rows))
        assert not out[len(rows):].any()
        return out[:len(rows)], block.route(torch.cat((rows, torch.zeros(pad, 128))), len(rows))

    mine = torch.randn(3, 128, generator=gen)
    with torch.inference_mode():
        alone, (weights, experts) = step(mine)
        for others in (1, 2, 3, 5, 8, 13, 31, 64):
            crowd = torch.randn(others, 128, generator=gen)
            at = others // 2  # my rows in the middle of the crowd
            out, (w, e) = step(torch.cat((crowd[:at], mine, crowd[at:])))
            assert torch.equal(out[at:at + 3], alone), f"rows differ in a crowd of {others}"
            assert torch.equal(e[at:at + 3], experts) and torch.equal(w[at:at + 3], weights)
    assert len(set(experts.flatten().tolist())) > 4  # the rows do go to different experts


def test_sparse_block_matches_a_loop_over_tokens():
    """Batched by expert == each token's experts one by one (same products, summed in expert id order)."""
    config = parse_config({**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": False})
    block = SparseMoeBlock(config, select_matmul("cpu", name="torch")).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(9, 64, generator=gen)
    with torch.inference_mode():
        got = block(x)
        weights, experts = block.route(x)
        for t in range(9):
            order = experts[t].argsort()
            want = sum(block.experts[int(experts[t, j])](x[t:t + 1])[0] * weights[t, j] for j in order.tolist())
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)


def test_qwen3_moe_refuses_tensor_parallelism_and_unknown_moe_fields():
    raw = {**SMALL, "architectures": ["Qwen3MoeForCausalLM"]}
    config = parse_config(raw)
    assert ShardPlan.of(config, 0, 1).size == 1
    with pytest.raises(ModelConfigError, match="num_experts"):
        ShardPlan.of(config, 0, 2)
    for field, value in (("shared_expert_intermediate_size", 128), ("n_shared_experts", 1),
                         ("scoring_func", "sigmoid"), ("routed_scaling_factor", 2.5)):
        with pytest.raises(ModelConfigError, match=field):
            parse_config({**raw, field: value})
    # training-only fields and a zero shared expert are fine; transformers 5's spelling of num_experts is read
    parse_config({**raw, "router_aux_loss_coef": 0.001, "output_router_logits": True,
                  "shared_expert_intermediate_size": 0})
    spelled = {k: v for k, v in raw.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert parse_config(spelled).num_experts == 8
    assert parse_config({**raw, "decoder_sparse_step": 2, "mlp_only_layers": []}).moe_layers == (1,)
    assert parse_config({**raw, "num_experts": 0}).moe_layers == ()
    sliding = parse_config({**raw, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    assert [sliding.layer_window(i) for i in range(3)] == [64, 64, 64]  # every layer, as transformers' Qwen3-MoE
