"""Gemma 3 text (four norms a layer, (1 + w) norms, interleaved sliding windows with their own RoPE base,
soft-capping) against transformers' Gemma3ForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.model.architectures import parse_config
from pagoda.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfigError
from pagoda.model.families.gemma3 import Gemma3DecoderLayer
from pagoda.model.loader import load_model
from tests.model.families.family_checks import check_batch_invariance, check_matches_transformers, save_random_hf

transformers = pytest.importorskip("transformers")

PROMPT = 40  # check_matches_transformers' prompt: longer than the window, so the sliding layers cut
ROPE = {FULL_ATTENTION: {"rope_type": "default", "rope_theta": 1_000_000.0},
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0}}
# Gemma 3's shape, small: 5 sliding layers and a full one; a query_pre_attn_scalar that is not head_dim
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=48, sliding_window=8,
             max_position_embeddings=512, rms_norm_eps=1e-6, rope_parameters=ROPE)


def save(tmp_path, std=0.05, **overrides):
    return save_random_hf(tmp_path, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, std=std,
                          **{**SMALL, **overrides})


def check_shape(model):
    """The model pagoda built is Gemma 3's: windows that cut on every 6th-but-one layer, its own RoPE there."""
    c = model.config
    assert c.family == "gemma3" and c.qk_norm and c.norm_offset == 1.0 and c.hidden_act == "gelu_pytorch_tanh"
    assert c.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert 0 < c.sliding_window < PROMPT  # the windows really cut within the prompt
    assert c.attention_scale == 48 ** -0.5 and c.embedding_multiplier == 64 ** 0.5
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4
    assert model.lm_head is None  # tied, as Gemma's default
    layers = model.model.layers
    assert all(isinstance(layer, Gemma3DecoderLayer) for layer in layers)
    assert [layer.self_attn.window for layer in layers] == [8] * 5 + [0]
    assert [layer.self_attn.rope_index for layer in layers] == [1] * 5 + [0]
    assert layers[0].post_feedforward_layernorm.weight.std() > 0  # the norms' weights were loaded, not zeros


def test_gemma3_matches_transformers(tmp_path):
    hf, d = save(tmp_path)
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    model = check_matches_transformers(hf, d, num_tokens=PROMPT)
    check_shape(model)
    assert model.config.rope_scaling is None


def test_gemma3_with_linear_rope_scaling_on_the_full_layers(tmp_path):
    """Gemma 3 4B+ stretch the full layers' RoPE (linear, factor 8); the sliding layers' stays unscaled."""
    rope = {**ROPE, FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    hf, d = save(tmp_path, rope_parameters=rope)
    model = check_matches_transformers(hf, d, num_tokens=PROMPT)
    check_shape(model)
    s = model.config.rope_scaling
    assert s is not None and (s.rope_type, s.factor) == ("linear", 8.0)


def test_gemma3_with_soft_capping(tmp_path):
    """Both caps set (null in the released Gemma 3), small enough that tanh bends: the logits are capped;
    the scores are not, as transformers' Gemma3Attention never applies `attn_logit_softcapping`."""
    hf, d = save(tmp_path, std=0.1, attn_logit_softcapping=2.0, final_logit_softcapping=1.0)
    model = check_matches_transformers(hf, d, num_tokens=PROMPT)
    check_shape(model)
    assert (model.config.attn_logit_softcapping, model.config.final_logit_softcapping) == (0.0, 1.0)
    assert all(layer.self_attn.softcap == 0.0 for layer in model.model.layers)
    ids = torch.arange(3, 3 + PROMPT)
    with torch.no_grad():
        capped = hf(ids[None]).logits[0]
        hf.config.final_logit_softcapping = None
        uncapped = hf(ids[None]).logits[0]
    assert (capped - uncapped).abs().max() > 0.05  # the final cap changes the logits


def test_gemma3_is_batch_invariant(tmp_path):
    _, d = save(tmp_path, std=0.1)
    check_batch_invariance(d)  # prompts of 13 and 22 tokens, 24 more each: past the window of 8


def test_older_config_spelling_is_read_alike(tmp_path):
    """Gemma 3 was released with `sliding_window_pattern`, `rope_theta`, `rope_local_base_freq` and
    `rope_scaling`, and without the fields left at their defaults (tie_word_embeddings among them)."""
    rope = {**ROPE, FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    _, d = save(tmp_path, rope_parameters=rope)
    new = json.loads((d / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters", "tie_word_embeddings")}
    old.pop("_sliding_window_pattern", None)
    old.update(sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert parse_config(old) == parse_config(new)
    old_hf = transformers.Gemma3TextConfig(**old)  # transformers reads it the same way
    assert old_hf.layer_types == new["layer_types"] and old_hf.rope_parameters == new["rope_parameters"]
    # without any pattern, every 6th layer is full; a pattern of 2, every other one
    no_pattern = {k: v for k, v in old.items() if k != "sliding_window_pattern"}
    assert parse_config(no_pattern).layer_types == parse_config(new).layer_types
    assert parse_config({**old, "sliding_window_pattern": 2}).layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 3


def test_model_type_alone_is_enough(tmp_path):
    _, d = save(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    del raw["architectures"]
    assert raw["model_type"] == "gemma3_text" and parse_config(raw).family == "gemma3"


@pytest.mark.parametrize(("change", "field"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_act"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {**ROPE, SLIDING_ATTENTION: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
], ids=["bidirectional", "exact-gelu", "no-window", "scaled-local-rope", "flat-rope", "bad-pattern"])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, change, field):
    _, d = save(tmp_path)
    raw = {**json.loads((d / "config.json").read_text()), **change}
    with pytest.raises(ModelConfigError, match=f"'{field}'"):
        parse_config(raw)


def test_the_multimodal_model_is_refused_by_its_name(tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B+ with vision) is not the text model pagoda runs."""
    _, d = save(tmp_path)
    text = json.loads((d / "config.json").read_text())
    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    (d / "config.json").write_text(json.dumps(multimodal))
    with pytest.raises(ModelConfigError, match="Gemma3ForConditionalGeneration") as refused:
        load_model(d, "float32", "cpu")
    assert "'architectures'" in str(refused.value) and "Gemma3ForCausalLM" in str(refused.value)  # what is supported
    with pytest.raises(ModelConfigError, match="'gemma3'"):  # by model_type alone, likewise
        parse_config({k: v for k, v in multimodal.items() if k != "architectures"})
