"""Loading HF directories: layouts, dtypes, errors, and logits against transformers' own models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagoda.model.config import ModelConfig, ModelConfigError
from pagoda.model.architectures import parse_config
from pagoda.model.loader import checkpoint_files, load_model, resolve_dtype
from pagoda.model.matmul import has_onednn_bf16
from tests.model.test_llama import empty_caches, paged_step

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)


def save_hf(tmp_path, arch, name="m", max_shard_size=None, **overrides):
    """A tiny random HF model saved with save_pretrained; returns (hf_model, directory)."""
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM, "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # HF's init leaves biases at zero and norms at one: make every weight matter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(tmp_path / name, **kwargs)
    return hf, tmp_path / name


def assert_logits_match_hf(hf, model_dir, num_tokens=40):
    model, config = load_model(model_dir, "float32", "cpu")
    ids = torch.randint(3, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = paged_step(model, empty_caches(model), [(ids, 0, list(range(num_tokens // 4 + 1)))])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    return model, config


def test_llama_logits_match_transformers(tmp_path):
    hf, d = save_hf(tmp_path, "llama")
    assert (d / "model.safetensors").is_file()
    assert_logits_match_hf(hf, d)


def test_qwen2_biases_match_transformers(tmp_path):
    hf, d = save_hf(tmp_path, "qwen2")
    _, config = assert_logits_match_hf(hf, d)
    assert config.qkv_bias and not config.o_proj_bias
    assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the biases are not zero


def test_mistral_without_window_matches_transformers(tmp_path):
    hf, d = save_hf(tmp_path, "mistral", sliding_window=None)
    _, config = assert_logits_match_hf(hf, d)
    assert config.architecture == "MistralForCausalLM"


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    # original context 16 with head_dim 16: the 8 frequencies fall in all three bands
    # (kept, blended, slowed), and 40 positions run well past the original context.
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf, d = save_hf(tmp_path, "llama", rope_scaling=scaling, rope_theta=10000.0, tie_word_embeddings=True)
    model, config = assert_logits_match_hf(hf, d)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 4.0 and config.tie_word_embeddings
    inv_freq = hf.model.rotary_emb.inv_freq
    from pagoda.model.llama import rope_inv_freq

    ours = rope_inv_freq(config)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    kept, slowed = ours == plain, torch.isclose(ours, plain / 4)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # all three bands present
    torch.testing.assert_close(ours, inv_freq.float())


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    hf, single = save_hf(tmp_path, "llama", name="single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    sharded = tmp_path / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    files = checkpoint_files(sharded)
    assert len(files) >= 3
    a, _ = load_model(single, "float32", "cpu")
    b, _ = load_model(sharded, "float32", "cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_dtypes(tmp_path):
    _, d = save_hf(tmp_path, "llama")
    # auto on the CPU: bfloat16 weights where oneDNN multiplies them natively, else the exact float32
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if has_onednn_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    model, _ = load_model(d, "float16", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model.rope_cos.dtype == torch.float16
    model, _ = load_model(d, "bfloat16", "cpu")  # native bf16 products: bf16 weights, float32 model around them
    want = torch.float32 if model.matmul.name == "onednn_bf16" else torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {want} and model.rope_cos.dtype == want
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("float8", torch.device("cpu"))


# -- errors name the file and the field --------------------------------------
def write_config(d, **changes):
    d.mkdir(exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nowhere", "float32", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path / "empty", "float32", "cpu")
    d = write_config(tmp_path / "noweights")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json in .*noweights"):
        load_model(d, "float32", "cpu")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="weight shard model-00002-of-00002.safetensors listed in .*index.json is missing"):
        load_model(d, "float32", "cpu")


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    hf, d = save_hf(tmp_path, "llama")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d, "float32", "cpu")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape \(3, 3\), expected \(96, 64\)"):
        load_model(d, "float32", "cpu")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"config\.json: field 'architectures' = \['GPT2LMHeadModel'\] is not supported"),
        ({"architectures": None, "model_type": "gpt2"}, r"'model_type' = 'gpt2' is not supported"),
        ({"hidden_size": None}, r"config\.json: required field 'hidden_size' is missing"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"field 'rope_scaling' has type 'yarn'; only 'llama3' and 'linear' are supported"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, r"rope_scaling' of type 'llama3' is missing 'low_freq_factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192}}, r"rope_scaling\.low_freq_factor must be"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
        ({"hidden_act": "gelu"}, r"field 'hidden_act' = 'gelu': only 'silu' is supported"),
        ({"sliding_window": 32}, r"field 'sliding_window' = 32: a Llama has no sliding window"),
    ],
)
def test_bad_configs_are_refused_with_the_field_named(tmp_path, changes, message):
    d = write_config(tmp_path / "bad", **changes)
    with pytest.raises(ModelConfigError, match=message) as info:
        load_model(d, "float32", "cpu")
    assert str(d / "config.json") in str(info.value)


def test_config_reads_old_and_new_rope_fields_and_eos_lists(tmp_path):
    old = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_theta": 500000.0, "eos_token_id": [2, 7],
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    config = parse_config(old)
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0 and config.eos_token_ids == (2, 7)
    new = {**old, "rope_theta": None, "rope_scaling": None,
           "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    config = parse_config(new, generation={"eos_token_id": [9, 2]})
    assert config.rope_theta == 100000.0 and config.rope_scaling is None and config.eos_token_ids == (2, 7, 9)
    assert config.head_dim == 16
