"""Phi-3 (fused qkv and gate_up tensors, a sliding window) against transformers' Phi3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from pagoda.model.config import ModelConfigError
from pagoda.model.loader import iter_checkpoint, load_model
from pagoda.model.shard import ShardPlan
from tests.model.families.family_checks import check_batch_invariance, check_matches_transformers, save_random_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save(tmp_path, **overrides):
    return save_random_hf(tmp_path, transformers.Phi3Config, transformers.Phi3ForCausalLM, **{**SMALL, **overrides})


def test_the_checkpoint_is_fused(tmp_path):
    _, d = save(tmp_path)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_phi3_matches_transformers(tmp_path, window):
    hf, d = save(tmp_path, sliding_window=window)
    model = check_matches_transformers(hf, d)
    assert model.config.family == "phi3" and model.config.sliding_window == (window or 0)


def test_a_rank_reads_its_heads_rows_of_the_fused_tensors(tmp_path):
    """Rank 1 of 2 holds KV head 1 and its query heads, and the second half of gate and of up."""
    from pagoda.model.families.phi3 import checkpoint_names

    _, d = save(tmp_path)
    model, config = load_model(d, "float32", "cpu")
    shard = ShardPlan.of(config, 1, 2)
    parts = dict(iter_checkpoint([d / "model.safetensors"], shard, checkpoint_names, config))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        qkv = f.get_tensor("model.layers.0.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.0.mlp.gate_up_proj.weight")
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    assert torch.equal(parts["model.layers.0.self_attn.q_proj.weight"], qkv[q // 2:q])
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], qkv[q + kv // 2:q + kv])
    assert torch.equal(parts["model.layers.0.self_attn.v_proj.weight"], qkv[q + kv + kv // 2:])
    lo, hi = shard.intermediate
    assert torch.equal(parts["model.layers.0.mlp.up_proj.weight"], gate_up[inter + lo:inter + hi])


def test_longrope_is_refused_naming_the_field(tmp_path):
    _, d = save(tmp_path)
    config = (d / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "longrope"')
    (d / "config.json").write_text(config)
    with pytest.raises(ModelConfigError, match="rope_scaling' has type 'longrope'"):
        load_model(d, "float32", "cpu")


def test_phi3_is_batch_invariant(tmp_path):
    _, d = save(tmp_path, sliding_window=8, std=0.1)  # shorter than the prompts (13, 22): the window cuts
    check_batch_invariance(d)
