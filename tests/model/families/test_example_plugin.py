"""A third-party architecture plugin (examples/olmo2_plugin), installed through its entry point, served unchanged."""

from __future__ import annotations

import shutil
from importlib import metadata

import httpx
import pytest

from pagoda.harness.live_server import live_server
from pagoda.model.architectures import Architectures, builtin_architectures, read_config
from pagoda.model.config import ModelConfigError
from pagoda.model.families import register_families
from pagoda.model.loader import load_model
from pagoda.plugins.manager import collect_architectures, describe_plugins, load_plugins
from tests.model.families.family_checks import check_matches_transformers, save_random_hf
from tests.model_fixtures import default_model_dir  # noqa: F401  (session fixture)

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


def installed() -> Architectures:
    return Architectures(collect_architectures(register_families(load_plugins({"PAGODA_PLUGINS": "olmo2"}))))


def test_the_plugin_is_loaded_through_its_entry_point():
    # `make test` installs examples/olmo2_plugin: an architecture needs no change to pagoda
    assert "olmo2" in {ep.name for ep in metadata.entry_points(group="pagoda")}
    info = {i.name: i for i in describe_plugins(load_plugins({"PAGODA_PLUGINS": "olmo2"}))}["olmo2"]
    assert info.origin == f"pagoda-olmo2 {metadata.version('pagoda-olmo2')}"
    assert info.provides == ("architecture 'olmo2' (Olmo2ForCausalLM)",)


def test_olmo2_matches_transformers_only_through_the_plugin(tmp_path):
    hf, d = save_random_hf(tmp_path, transformers.Olmo2Config, transformers.Olmo2ForCausalLM, **SMALL)
    with pytest.raises(ModelConfigError, match="'architectures' = \\['Olmo2ForCausalLM'\\] is not supported"):
        read_config(d, builtin_architectures())
    model, _ = load_model(d, "float32", "cpu", architectures=installed())
    assert type(model.model.layers[0]).__name__ == "Olmo2DecoderLayer"
    check_matches_transformers(hf, d, architectures=installed())


def test_a_server_serves_it_and_its_card_names_the_plugin(tmp_path, default_model_dir):  # noqa: F811
    vocab = read_config(default_model_dir).vocab_size  # the default model's tokenizer, on random OLMo 2 weights
    _, d = save_random_hf(tmp_path, transformers.Olmo2Config, transformers.Olmo2ForCausalLM, std=0.3,
                          **{**SMALL, "vocab_size": vocab})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, d / name)
    with live_server(d, "olmo", environ={"PAGODA_PLUGINS": "olmo2"}, num_blocks=64,
                     block_size=16, max_model_len=512) as live:
        card = httpx.get(f"{live.url}/v1/models", timeout=30).json()["data"][0]
        assert card["architecture"] == {"name": "Olmo2ForCausalLM", "plugin": "olmo2"}
        reply = live.openai().chat.completions.create(model="olmo", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        live.assert_pool_whole()
