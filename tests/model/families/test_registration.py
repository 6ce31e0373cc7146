"""The built-in families join a plugin manager when a model is built, not when the plugins load
(pagoda/model/families/__init__.py): loading the protocols imports no family, yet any family is left out by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.model.architectures import Architectures
from pagoda.model.config import ModelConfigError
from pagoda.model.families import register_families
from pagoda.plugins.manager import (BUILTIN_ARCHITECTURES, PluginError, collect_architectures, describe_plugins,
                                    load_plugins)

NONE = {"PAGODA_PLUGINS": "none"}


def test_loading_the_plugins_imports_no_family_and_no_torch():
    """In a fresh process: the protocols, the routes, the policies and the tool parsers load; the model room not."""
    code = ("import sys; from pagoda.plugins.manager import collect_endpoints, load_plugins; "
            "pm = load_plugins({'PAGODA_PLUGINS': 'none'}); assert collect_endpoints(pm); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xgrammar') "
            "or m.startswith('pagoda.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_families_are_registered_under_the_names_the_manager_knows():
    pm = load_plugins(NONE)
    assert collect_architectures(pm) == []  # none until a model is built
    assert register_families(pm) is pm
    assert [name for name, _ in pm.list_name_plugin() if name in BUILTIN_ARCHITECTURES] == list(BUILTIN_ARCHITECTURES)
    assert {a.name for a in collect_architectures(pm)} == set(BUILTIN_ARCHITECTURES)
    register_families(pm)  # twice is once
    assert len(collect_architectures(pm)) == len(BUILTIN_ARCHITECTURES)
    infos = {i.name: i for i in describe_plugins(pm)}
    assert infos["qwen3"].origin == "built-in" and infos["qwen3"].provides == ("architecture 'qwen3' (Qwen3ForCausalLM)",)


def test_a_family_left_out_by_name_is_not_registered():
    pm = register_families(load_plugins(NONE, disabled=["mistral"]))
    registry = Architectures(collect_architectures(pm))
    assert "mistral" not in registry.by_name and "llama" in registry.by_name
    with pytest.raises(ModelConfigError, match="'MistralForCausalLM'\\] is not supported"):
        registry.for_config({"architectures": ["MistralForCausalLM"]})
    info = {i.name: i for i in describe_plugins(pm)}["mistral"]
    assert info.disabled and info.origin == "built-in"


def test_a_family_can_be_left_out_where_no_model_is_built():
    """The router reads PAGODA_DISABLE_PLUGINS as `pagoda serve` does: a family's name is known there too."""
    pm = load_plugins({**NONE, "PAGODA_DISABLE_PLUGINS": "qwen3_moe"})
    assert pm.is_blocked("qwen3_moe")
    with pytest.raises(PluginError, match="cannot disable 'qwen4'"):
        load_plugins(NONE, disabled=["qwen4"])
