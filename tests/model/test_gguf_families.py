"""GGUF files of the qwen3, gemma3 and phi3 architectures, imported through the layouts their family plugins
register (`import_gguf`'s default), against transformers on the same weights; qwen3moe refused by name.

Each file is written as llama.cpp's converter writes it (tests/model/gguf_files.py): the gguf library's
name map, Gemma 3's norms stored plus 1, Phi-3's qkv and gate/up kept fused, each converter's keys.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from pagoda.model.architectures import builtin_architectures
from pagoda.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from pagoda.model.gguf_import import import_gguf
from pagoda.model.gguf_layout import GEMMA3_GGUF, PHI3_GGUF, QWEN3_GGUF
from tests.model.families.family_checks import check_matches_transformers, save_random_hf
from tests.model.gguf_files import byte_level_vocab, write_gguf

transformers = pytest.importorskip("transformers")

VOCAB = len(byte_level_vocab()["tokens"])  # the file's tokenizer and the model agree on the vocabulary
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
PROMPT = 40  # check_matches_transformers' prompt: longer than every window below
ROPE = {FULL_ATTENTION: {"rope_type": "default", "rope_theta": 1_000_000.0},
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0}}
# Gemma 3's shape, small: 5 sliding layers and a full one; query_pre_attn_scalar = head_dim, as the file implies
GEMMA3 = dict(BASE, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
              rms_norm_eps=1e-6, rope_parameters=ROPE)


def imported(tmp_path, hf, arch, qtype="F32", **options):
    """Write `hf` as llama.cpp's converter would, import it with the default (registered) layouts."""
    reference = write_gguf(tmp_path / f"{arch}.gguf", hf.state_dict(), hf.config, qtype, arch=arch, **options)
    directory = import_gguf(tmp_path / f"{arch}.gguf", tmp_path / f"{arch}-imported", progress=False)
    return directory, json.loads((directory / "config.json").read_text()), reference


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_file_matches_transformers(tmp_path, tied):
    """qwen3: q/k head norms, no biases, rows as stored (NeoX RoPE), head_dim from `qwen3.attention.key_length`
    (32 here, not hidden / heads = 16), output.weight only when untied."""
    hf, _ = save_random_hf(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                           **BASE, num_hidden_layers=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    directory, config, _ = imported(tmp_path, hf, "qwen3")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert config["tie_word_embeddings"] is tied and config["attention_bias"] is False
    model = check_matches_transformers(hf, directory)
    assert model.config.family == "qwen3" and model.config.qk_norm and (model.lm_head is None) == tied
    assert model.model.layers[0].self_attn.q_norm.weight.std() > 0  # the norms were read, not left at one


def test_gemma3_file_matches_transformers(tmp_path):
    """gemma3: four norms a layer, stored 1 + w and read back as w; every 6th layer full (llama.cpp's default),
    a window of 8 under a 40-token prompt, the sliding layers' RoPE base 10000, the full ones' the file's."""
    hf, _ = save_random_hf(tmp_path, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, **GEMMA3)
    directory, config, _ = imported(tmp_path, hf, "gemma3")
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["layer_types"] == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION] and config["sliding_window"] == 8
    assert config["rope_parameters"] == ROPE and config["query_pre_attn_scalar"] == 32
    assert config["hidden_activation"] == "gelu_pytorch_tanh" and config["tie_word_embeddings"] is True
    weights = load_file(str(directory / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.0.post_feedforward_layernorm.weight",
                 "model.layers.0.self_attn.k_norm.weight"):
        np.testing.assert_allclose(weights[name], hf.state_dict()[name].numpy(), rtol=0, atol=1e-6)
    model = check_matches_transformers(hf, directory, num_tokens=PROMPT)
    c = model.config
    assert c.family == "gemma3" and c.norm_offset == 1.0 and c.hidden_act == "gelu_pytorch_tanh"
    assert (c.rope_theta, c.rope_local_theta, c.attention_scale) == (1e6, 1e4, 32 ** -0.5)
    assert [layer.self_attn.window for layer in model.model.layers] == [8] * 5 + [0]


def test_gemma3_q8_0_file_with_a_pattern_and_scaled_full_layers(tmp_path):
    """Q8_0 weights through the new layouts; `gemma3.attention.sliding_window_pattern` as one bool per layer
    (newer files) overrides the every-6th default; linear RoPE scaling (Gemma 3 4B+) on the full layers only."""
    types = [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]
    rope = {**ROPE, FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    hf, _ = save_random_hf(tmp_path, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                           **{**GEMMA3, "layer_types": types, "rope_parameters": rope})
    pattern = [t == SLIDING_ATTENTION for t in types]
    directory, config, reference = imported(tmp_path, hf, "gemma3", "Q8_0",
                                            metadata={"{arch}.attention.sliding_window_pattern": pattern})
    assert config["layer_types"] == types and config["rope_parameters"] == rope
    before = hf.model.layers[0].self_attn.q_proj.weight.clone()
    with torch.no_grad():  # transformers on the file's weights: Q8_0's rounding, the same for both
        missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    assert not torch.equal(hf.model.layers[0].self_attn.q_proj.weight, before)  # the file's weights are rounded
    model = check_matches_transformers(hf, directory, num_tokens=PROMPT)
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [8 if t == SLIDING_ATTENTION else 0 for t in types]
    s = model.config.rope_scaling
    assert s is not None and (s.rope_type, s.factor) == ("linear", 8.0)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_phi3_file_matches_transformers(tmp_path, window):
    """phi3: fused attn_qkv and ffn_up (gate then up) become qkv_proj / gate_up_proj, which the phi3 family splits
    by rows as for an HF checkpoint; `phi3.attention.sliding_window` (0: none) over every layer."""
    hf, _ = save_random_hf(tmp_path, transformers.Phi3Config, transformers.Phi3ForCausalLM,
                           **BASE, num_hidden_layers=2, original_max_position_embeddings=512, rms_norm_eps=1e-5,
                           pad_token_id=0, sliding_window=window)
    directory, config, _ = imported(tmp_path, hf, "phi3")
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["sliding_window"] == window
    names = set(load_file(str(directory / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    model = check_matches_transformers(hf, directory)
    assert model.config.family == "phi3" and model.config.sliding_window == (window or 0)


def test_refusals(tmp_path):
    """qwen3moe (no layout claims it), a Mixtral written as llama, Phi-3's longrope factors: each named."""
    import gguf

    def minimal(name, arch, **keys):
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        for key, value in keys.items():
            writer.add_uint32(key, value)
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
        return tmp_path / name

    with pytest.raises(ValueError, match=r"'general.architecture' = 'qwen3moe' cannot be imported "
                                         r"\(supported: gemma3, llama, phi3, qwen2, qwen3\)"):
        import_gguf(minimal("moe.gguf", "qwen3moe", **{"qwen3moe.expert_count": 8}), tmp_path / "moe", progress=False)
    with pytest.raises(ValueError, match=r"'llama.expert_count' = 8: not supported"):
        import_gguf(minimal("mixtral.gguf", "llama", **{"llama.expert_count": 8}), tmp_path / "mixtral", progress=False)

    hf, _ = save_random_hf(tmp_path, transformers.Phi3Config, transformers.Phi3ForCausalLM,
                           **BASE, num_hidden_layers=1, original_max_position_embeddings=512, pad_token_id=0)
    factors = np.ones(8, dtype=np.float32)
    write_gguf(tmp_path / "long.gguf", hf.state_dict(), hf.config, "F32", arch="phi3",
               extra={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(ValueError, match=r"'rope_factors_long.weight'.*longrope"):
        import_gguf(tmp_path / "long.gguf", tmp_path / "long", progress=False)
    assert not any(p.name in ("moe", "mixtral", "long") for p in tmp_path.iterdir())


def test_the_families_register_their_layouts():
    layouts = builtin_architectures().gguf_layouts
    assert (layouts["qwen3"], layouts["gemma3"], layouts["phi3"]) == (QWEN3_GGUF, GEMMA3_GGUF, PHI3_GGUF)
    assert "qwen3moe" not in layouts and not any(layout.permute_qk for layout in (QWEN3_GGUF, GEMMA3_GGUF, PHI3_GGUF))


def _gemma3_meta(**overrides):
    meta = {"gemma3.embedding_length": 64, "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
            "gemma3.attention.key_length": 32, "gemma3.feed_forward_length": 128, "gemma3.block_count": 6,
            "gemma3.context_length": 256, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 16, **overrides}
    return {k: v for k, v in meta.items() if v is not None}


TENSORS = {"token_embd.weight": SimpleNamespace(shape=np.array([64, 100]))}
S, F = SLIDING_ATTENTION, FULL_ATTENTION


@pytest.mark.parametrize(("overrides", "types"), [
    ({}, [S, S, S, S, S, F]),
    ({"gemma3.attention.sliding_window_pattern": 2}, [S, F] * 3),
    ({"gemma3.attention.sliding_window_pattern": 0}, [S] * 6),  # llama.cpp: 0 slides every layer
    ({"gemma3.attention.sliding_window_pattern": [True, False] * 3}, [S, F] * 3),
    ({"gemma3.attention.sliding_window": None}, [F] * 6),  # no window: every layer full
], ids=["default-6", "every-2nd", "zero", "bools", "no-window"])
def test_gemma3_layer_kinds_from_metadata(overrides, types):
    config = GEMMA3_GGUF.config(_gemma3_meta(**overrides), TENSORS)
    assert config["layer_types"] == types


def test_gemma3_config_details():
    config = GEMMA3_GGUF.config(_gemma3_meta(**{"gemma3.final_logit_softcapping": 30.0}), TENSORS)
    assert config["query_pre_attn_scalar"] == 32 and config["final_logit_softcapping"] == 30.0
    assert config["rope_parameters"][SLIDING_ATTENTION] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_theta" not in config and "rope_scaling" not in config and "hidden_act" not in config
    # the 27B (62 layers): llama.cpp scales by (hidden / heads)^-1/2 = 168^-1/2, not head_dim's
    big = GEMMA3_GGUF.config(_gemma3_meta(**{"gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                                             "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128}),
                             {"token_embd.weight": SimpleNamespace(shape=np.array([5376, 100]))})
    assert big["query_pre_attn_scalar"] == 168 and big["head_dim"] == 128
    swa = GEMMA3_GGUF.config(_gemma3_meta(**{"gemma3.rope.freq_base_swa": 20000.0}), TENSORS)
    assert swa["rope_parameters"][SLIDING_ATTENTION]["rope_theta"] == 20000.0
    with pytest.raises(ValueError, match="'gemma3.attention.sliding_window_pattern'"):
        GEMMA3_GGUF.config(_gemma3_meta(**{"gemma3.attention.sliding_window_pattern": [True, False]}), TENSORS)
    with pytest.raises(ValueError, match="'gemma3.rope.scaling.type' = 'yarn'"):
        GEMMA3_GGUF.config(_gemma3_meta(**{"gemma3.rope.scaling.type": "yarn"}), TENSORS)
