"""The importer's architecture seam: the llama and qwen2 layouts, Llama 3's rope_freqs, a fix-up hook, refusals."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagoda.model.gguf_import import BLOCK_FILES, import_gguf
from pagoda.model.architectures import builtin_architectures
from pagoda.model.gguf_layout import LLAMA_GGUF, QWEN2_GGUF, GgufLayout, layouts_by_architecture
from tests.model.gguf_files import byte_level_vocab, write_gguf

transformers = pytest.importorskip("transformers")

IDS = [5, 17, 90, 250, 33, 71, 12, 199, 150, 64, 3, 88, 140, 222, 9, 45, 101, 180, 27, 66]
SIZES = dict(vocab_size=len(byte_level_vocab()["tokens"]), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
             initializer_range=0.05, bos_token_id=1, eos_token_id=2)


def _logits(directory, ids):
    from pagoda.model.loader import load_model

    model, _ = load_model(directory, dtype="float32", device="cpu", max_positions=64)
    with torch.no_grad():
        return model.reference_forward(torch.tensor(ids))


def _hf(config_class, seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config_class(**{**SIZES, **overrides})).eval()


def test_qwen2_file_matches_transformers(tmp_path):
    """qwen2: biases on q/k/v, rows as HF has them (no permutation), tied embeddings, `qwen2.*` keys."""
    import json

    model = _hf(transformers.Qwen2Config, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)
    with torch.no_grad():  # HF initialises biases to zero: give them values, or a wrong permutation would not show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    vocab = {**byte_level_vocab(), "pre": "qwen2"}
    write_gguf(tmp_path / "q.gguf", model.state_dict(), model.config, "F32", arch="qwen2", vocab=vocab)
    directory = import_gguf(tmp_path / "q.gguf", tmp_path / "imported", progress=False)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0]
    assert (_logits(directory, IDS) - want).abs().max() <= 1e-5


def _llama_cpp_rope_factors(scaling, theta, dim):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, for rope_type llama3."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """Llama 3.1's GGUF has no rope_scaling keys, only `rope_freqs.weight`: read back as an equivalent llama3 one."""
    import json

    # low 2 / high 8 / 128 tokens puts several frequencies in the smoothed band; the importer writes the
    # equivalent low 1 / high 4 / 64 (only old/low and old/high matter)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 128}
    model = _hf(transformers.LlamaConfig, rope_parameters={"rope_theta": 10000.0, **scaling})
    factors = _llama_cpp_rope_factors(scaling, 10000.0, 64)
    assert ((factors > 1) & (factors < 8)).sum() >= 2
    write_gguf(tmp_path / "l.gguf", model.state_dict(), model.config, "F32", extra={"rope_freqs.weight": factors})
    directory = import_gguf(tmp_path / "l.gguf", tmp_path / "imported", progress=False)
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0
    assert config["rope_scaling"]["original_max_position_embeddings"] / config["rope_scaling"]["high_freq_factor"] == 16
    ids = (IDS * 3)[:48]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert (_logits(directory, ids) - want).abs().max() <= 1e-4
    plain = _hf(transformers.LlamaConfig)  # the same weights without the scaling answer differently
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(torch.tensor([ids])).logits[0] - want).abs().max() > 1e-3

    bent = factors.copy()
    bent[factors.argmax() - 3] *= 1.5
    write_gguf(tmp_path / "bad.gguf", model.state_dict(), model.config, "F32", extra={"rope_freqs.weight": bent})
    with pytest.raises(ValueError, match="rope_freqs.weight.*does not match Llama 3"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "bad", progress=False)


def test_a_layout_fix_up_hook_and_the_blocks_it_leaves(tmp_path):
    """fix_tensor changes a weight after dequantization; a Q4_0 weight it changes keeps no blocks."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    model = _hf(transformers.LlamaConfig)

    def plus_one(name, w, config):  # as a Gemma layout undoes its converter's +1 on norms
        return w + 1 if name.endswith("norm.weight") or name.endswith("o_proj.weight") else w

    layout = dataclasses.replace(LLAMA_GGUF, fix_tensor=plus_one)
    reference = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, "Q4_0")
    directory = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", progress=False, layouts={"llama": layout})
    ours = load_file(str(directory / "model.safetensors"))
    for name, want in reference.items():
        shifted = name.endswith("norm.weight") or name.endswith("o_proj.weight")
        np.testing.assert_array_equal(ours[name], want + 1 if shifted else want)
    with safe_open(str(directory / BLOCK_FILES["Q4_0"]), framework="np") as f:
        kept = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in kept and "model.layers.0.self_attn.o_proj.weight" not in kept


def test_refusals(tmp_path):
    import gguf

    model = _hf(transformers.LlamaConfig)
    write_gguf(tmp_path / "iq.gguf", model.state_dict(), model.config, "Q8_0", raw_type={"blk.0.attn_q.weight": "IQ2_XXS"})
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.attn_q.weight' has type IQ2_XXS, which pagoda does not "
                                         r"load \(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        import_gguf(tmp_path / "iq.gguf", tmp_path / "iq", progress=False)

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match=r"'general.architecture' = 'mamba' cannot be imported "
                                         r"\(supported: gemma3, llama, phi3, qwen2, qwen3\)"):
        import_gguf(tmp_path / "mamba.gguf", tmp_path / "mamba", progress=False)

    write_gguf(tmp_path / "llama.gguf", model.state_dict(), model.config, "F32")
    with pytest.raises(ValueError, match=r"'llama' cannot be imported \(supported: qwen2\)"):
        import_gguf(tmp_path / "llama.gguf", tmp_path / "l", progress=False, layouts={"qwen2": QWEN2_GGUF})
    assert not any(p.name.startswith(("iq", "mamba", "l")) for p in tmp_path.iterdir() if p.is_dir())


def _meta(**overrides):
    meta = {"llama.embedding_length": 64, "llama.attention.head_count": 4, "llama.feed_forward_length": 128,
            "llama.block_count": 2, "llama.context_length": 256, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            **overrides}
    return {k: v for k, v in meta.items() if v is not None}


TENSORS = {"token_embd.weight": SimpleNamespace(shape=np.array([64, 100]))}


def test_llama_config_from_metadata():
    config = LLAMA_GGUF.config(_meta(**{"llama.rope.freq_base": 500000.0}), TENSORS)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 100
    assert (config["num_key_value_heads"], config["head_dim"], config["rope_theta"]) == (4, 16, 500000.0)
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False
    with pytest.raises(ValueError, match="'llama.block_count' is missing"):
        LLAMA_GGUF.config(_meta(**{"llama.block_count": None}), TENSORS)
    with pytest.raises(ValueError, match="'llama.rope.scaling.type' = 'yarn'"):
        LLAMA_GGUF.config(_meta(**{"llama.rope.scaling.type": "yarn"}), TENSORS)
    linear = LLAMA_GGUF.config(_meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}), TENSORS)
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="'llama.rope.scaling.factor' is missing"):
        LLAMA_GGUF.config(_meta(**{"llama.rope.scaling.type": "linear"}), TENSORS)
    with pytest.raises(ValueError, match="'llama.expert_count' = 8"):  # Mixtral is written as llama
        LLAMA_GGUF.config(_meta(**{"llama.expert_count": 8}), TENSORS)
    with pytest.raises(ValueError, match="'llama.rope.dimension_count' = 8"):
        LLAMA_GGUF.config(_meta(**{"llama.rope.dimension_count": 8}), TENSORS)
    with pytest.raises(ValueError, match="'qwen2.embedding_length' is missing"):
        QWEN2_GGUF.config(_meta(), {**TENSORS, "blk.0.attn_q.bias": None})


def test_layout_table():
    layouts = builtin_architectures().gguf_layouts  # the built-in architecture plugins list their layouts
    assert layouts["llama"] is LLAMA_GGUF and layouts["qwen2"] is QWEN2_GGUF
    assert LLAMA_GGUF.permute_qk and not QWEN2_GGUF.permute_qk
    with pytest.raises(ValueError, match="'llama' has two GGUF layouts"):
        layouts_by_architecture(LLAMA_GGUF, dataclasses.replace(LLAMA_GGUF, architectures=("mistral", "llama")))
    with pytest.raises(ValueError, match="at least one"):
        GgufLayout(architectures=(), config=LLAMA_GGUF.config, layer_names={}, global_names={})
    rows = np.arange(8 * 3).reshape(8, 3)
    config = {"num_attention_heads": 2, "num_key_value_heads": 1}
    assert QWEN2_GGUF.torch_rows("blk.0.attn_q.weight", rows, config) is rows
    assert not np.array_equal(LLAMA_GGUF.torch_rows("blk.0.attn_q.weight", rows, config), rows)
    assert LLAMA_GGUF.torch_rows("blk.0.attn_v.weight", rows, config) is rows
