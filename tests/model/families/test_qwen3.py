"""Qwen3 (per-head q/k norms; tied or untied embeddings) against transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import pytest

from tests.model.families.family_checks import check_batch_invariance, check_matches_transformers, save_random_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_matches_transformers(tmp_path, tied):
    hf, d = save_random_hf(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                           tie_word_embeddings=tied, **SMALL)
    model = check_matches_transformers(hf, d)
    assert model.config.family == "qwen3" and model.config.qk_norm
    assert (model.lm_head is None) == tied
    assert model.model.layers[0].self_attn.q_norm.weight.std() > 0  # the norms' weights were loaded, not ones


def test_qwen3_is_batch_invariant(tmp_path):
    _, d = save_random_hf(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, std=0.1, **SMALL)
    check_batch_invariance(d)
