"""Llama, Mistral (now with its sliding window) and Qwen2 through their plugins: against transformers, and
batch invariant alone / in a crowd / preempted (the other Llama-family checks live in tests/model/test_loader.py)."""

from __future__ import annotations

import pytest

from tests.model.families.family_checks import check_batch_invariance, check_matches_transformers, save_random_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def test_mistral_with_a_window_shorter_than_the_prompt_matches_transformers(tmp_path):
    config_cls, model_cls, extra = FAMILIES["mistral"]
    hf, d = save_random_hf(tmp_path, config_cls, model_cls, **SMALL, **extra)
    model = check_matches_transformers(hf, d, num_tokens=40)
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8]  # 40 tokens: the window cuts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_is_batch_invariant(tmp_path, family):
    config_cls, model_cls, extra = FAMILIES[family]
    _, d = save_random_hf(tmp_path, config_cls, model_cls, std=0.1, **SMALL, **extra)
    check_batch_invariance(d)
