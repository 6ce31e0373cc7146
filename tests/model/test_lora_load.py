"""What pagoda refuses to load as a LoRA adapter, and how it says so: AdapterError naming the field.

Every case starts from a good peft-made adapter of the tiny model and breaks one thing, as a user's mistake or a
trainer's option pagoda does not serve would. The engine is unchanged by a refusal: the good adapter still loads.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.core.adapters import AdapterError
from pagoda.core.engine_config import EngineConfig
from pagoda.model.config import named_config
from pagoda.model.factory import make_engine
from pagoda.model.llama import build_model
from pagoda.model.lora import WEIGHTS_FILE
from tests.distributed.helpers import save_model_dir
from tests.lora_files import edit_config, hf_model, save_random_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the tiny model's directory, a good adapter of it, an adapter of a wider model)"""
    out = tmp_path_factory.mktemp("lora")
    whole = build_model(named_config("tiny"), max_positions=512)
    whole.init_random_weights(seed=5, std=0.1)
    model_dir = save_model_dir(whole, out / "tiny")
    good = save_random_adapter(hf_model(model_dir), out / "good", rank=8)
    wide = build_model(named_config("tiny").__class__(**{**named_config("tiny").__dict__, "hidden_size": 128}),
                       max_positions=512)
    wide.init_random_weights(seed=5, std=0.1)
    other = save_random_adapter(hf_model(save_model_dir(wide, out / "wide")), out / "other", rank=8)
    return model_dir, good, other


@pytest.fixture
def engine(made):
    from pagoda.model.loader import load_model

    model, _ = load_model(made[0], "float32", "cpu", max_positions=512)
    return make_engine(model, EngineConfig(num_blocks=32, block_size=4, max_model_len=512, max_lora_rank=16))


def broken(made, tmp_path, **config):
    """A copy of the good adapter with `config` fields changed."""
    copy = shutil.copytree(made[1], tmp_path / "broken")
    if config:
        edit_config(copy, **config)
    return copy


def rewrite(directory, change):
    tensors = load_file(str(directory / WEIGHTS_FILE))
    save_file(change(tensors), str(directory / WEIGHTS_FILE))
    return directory


def renamed(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


def with_nan(tensors):
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    return tensors


CASES = {
    "missing directory": (lambda made, tmp: tmp / "nowhere", "lora_path", "not a directory"),
    "no config": (lambda made, tmp: _without(broken(made, tmp), "adapter_config.json"), "lora_path", "adapter_config"),
    "no weights": (lambda made, tmp: _without(broken(made, tmp), WEIGHTS_FILE), "lora_path", "safetensors"),
    "rank over the limit": (lambda made, tmp: broken(made, tmp, r=32), "r", "--max-lora-rank"),
    "DoRA": (lambda made, tmp: broken(made, tmp, use_dora=True), "use_dora", "DoRA"),
    "modules_to_save": (lambda made, tmp: broken(made, tmp, modules_to_save=["lm_head"]), "modules_to_save", "modules_to_save"),
    "trained biases": (lambda made, tmp: broken(made, tmp, bias="all"), "bias", "trained biases"),
    "another PEFT method": (lambda made, tmp: broken(made, tmp, peft_type="IA3"), "peft_type", "only LoRA"),
    "shapes of another model": (lambda made, tmp: made[2], "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
                                "does not fit"),
    "a module the family lacks": (lambda made, tmp: rewrite(broken(made, tmp), lambda t: renamed(t, "q_proj", "c_attn")),
                                  "target_modules", "no self_attn.c_attn"),
    "fused qkv on a Llama": (lambda made, tmp: rewrite(broken(made, tmp), lambda t: renamed(t, "q_proj", "qkv_proj")),
                             "target_modules", "qkv_proj"),
    "an embedding": (lambda made, tmp: rewrite(broken(made, tmp), lambda t: {
        **t, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 512)}),
        "target_modules", "embedding"),
    "NaN": (lambda made, tmp: rewrite(broken(made, tmp), with_nan), "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
            "NaN"),
    "a lone A": (lambda made, tmp: rewrite(broken(made, tmp), lambda t: {k: v for k, v in t.items()
                                                                         if "layers.1.self_attn.v_proj.lora_B" not in k}),
                 "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight", "lora_B is missing"),
}


def _without(directory, name):
    (directory / name).unlink()
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_adapter_is_refused_naming_the_field(made, engine, tmp_path, case):
    make, field, words = CASES[case]
    with pytest.raises(AdapterError, match=words) as refused:
        engine.load_adapter("x", str(make(made, tmp_path)))
    assert refused.value.field == field, str(refused.value)
    assert engine.adapters.loaded == {} and engine.runner.adapters == {}
    info = engine.load_adapter("x", str(made[1]))  # the engine is whole: the good one loads under the same name
    assert info.rank == 8 and info.nbytes > 0


def test_loading_a_name_twice_is_refused_and_unloading_frees_it(made, engine):
    engine.load_adapter("x", str(made[1]))
    with pytest.raises(AdapterError) as refused:
        engine.load_adapter("x", str(made[1]))
    assert refused.value.field == "lora_name"
    assert engine.stats()["lora_adapter_bytes"] == engine.adapters.loaded["x"].nbytes > 0
    assert engine.unload_adapter("x").done()  # nobody uses it: at once
    assert engine.runner.adapters == {} and engine.stats()["lora_adapter_bytes"] == 0


def test_a_mixture_of_experts_adapts_its_attention_only(tmp_path):
    from tests.model.families.test_qwen3_moe import _hf

    hf, model_dir = _hf(tmp_path)
    from pagoda.model.loader import load_model

    model, _ = load_model(model_dir, "float32", "cpu", max_positions=256)
    engine = make_engine(model, EngineConfig(num_blocks=32, block_size=4, max_model_len=256))
    attention = save_random_adapter(hf, tmp_path / "attn", targets=("q_proj", "v_proj"))
    assert engine.load_adapter("attn", str(attention)).target_modules == ("q_proj", "v_proj")
    # an MLP of a sparse layer (its experts)
    experts = rewrite(shutil.copytree(attention, tmp_path / "experts"),
                      lambda t: renamed(t, "layers.0.self_attn.v_proj", "layers.0.mlp.gate_proj"))
    with pytest.raises(AdapterError, match="mixture of experts") as refused:
        engine.load_adapter("experts", str(experts))
    assert refused.value.field == "target_modules"
