"""The plugin system: built-ins registered like third-party plugins, entry points, the allow-list."""

import json
from importlib import metadata

import pytest

from pagoda.cli.main import main as cli_main
from pagoda.plugins import hookimpl
from pagoda.plugins.builtin.disconnect_abort import AbortOnDisconnect
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.manager import (
    BUILTIN_PLUGINS,
    PluginError,
    collect_disconnect_policies,
    collect_endpoints,
    describe_plugins,
    load_plugins,
)
from pagoda.plugins.protocol import Endpoint

BUILTIN_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}


def test_builtin_plugins_provide_the_four_protocols_and_the_abort_policy():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    assert [name for name, _ in pm.list_name_plugin()] == list(BUILTIN_PLUGINS)
    assert {e.path for e in collect_endpoints(pm)} == BUILTIN_PATHS
    policies = collect_disconnect_policies(pm)
    assert sorted(policies) == ["abort", "finish"] and isinstance(policies["abort"], AbortOnDisconnect)
    infos = {i.name: i for i in describe_plugins(pm)}
    assert infos["pagoda.plugins.builtin.openai_chat"].origin == "built-in"
    assert infos["pagoda.plugins.builtin.openai_chat"].hooks == ("pagoda_register_protocols",)
    assert infos["pagoda.plugins.builtin.openai_chat"].provides == ("POST /v1/chat/completions (openai-chat)",)


def test_the_example_plugin_is_installed_and_loaded_through_its_entry_point():
    # `make test` installs examples/ollama_plugin; this proves a protocol needs no change to pagoda.
    entry_points = {ep.name: ep for ep in metadata.entry_points(group="pagoda")}
    assert "ollama" in entry_points, "examples/ollama_plugin is not installed (pip install -e examples/ollama_plugin)"
    pm = load_plugins({})
    assert {e.path for e in collect_endpoints(pm)} == BUILTIN_PATHS | {"/api/generate", "/api/chat"}
    info = {i.name: i for i in describe_plugins(pm)}["ollama"]
    assert info.origin == f"pagoda-ollama {metadata.version('pagoda-ollama')}"
    assert info.provides == ("POST /api/generate (ollama-generate)", "POST /api/chat (ollama-chat)")


@pytest.mark.parametrize("value, loaded",
                         [(None, True), ("none", False), ("", False), ("ollama", True), (" ollama , ", True)])
def test_the_allow_list_decides_which_installed_plugins_load(value, loaded):
    environ = {} if value is None else {"PAGODA_PLUGINS": value}
    names = [name for name, _ in load_plugins(environ).list_name_plugin()]
    assert names[: len(BUILTIN_PLUGINS)] == list(BUILTIN_PLUGINS)  # built-ins always load
    assert ("ollama" in names) is loaded


def test_naming_a_plugin_that_is_not_installed_is_an_error():
    with pytest.raises(PluginError, match="not installed: no-such-plugin"):
        load_plugins({"PAGODA_PLUGINS": "ollama,no-such-plugin"})


class EchoEndpoint(Endpoint):
    name = "echo"
    path = "/echo"
    body_type = dict


class QuietPolicy(DisconnectPolicy):
    name = "quiet"


class InlinePlugin:
    @hookimpl
    def pagoda_register_protocols(self, register):
        register(EchoEndpoint())

    @hookimpl
    def pagoda_register_disconnect_policies(self, register):
        register(QuietPolicy())


def test_a_plugin_registered_in_code_joins_the_same_registry():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(InlinePlugin(), name="inline")
    try:
        assert "/echo" in {e.path for e in collect_endpoints(pm)}
        assert set(collect_disconnect_policies(pm)) == {"abort", "finish", "quiet"}
        info = {i.name: i for i in describe_plugins(pm)}["inline"]
        assert info.origin == "registered in code"
        assert info.hooks == ("pagoda_register_disconnect_policies", "pagoda_register_protocols")
    finally:
        pm.unregister(name="inline")
    assert "/echo" not in {e.path for e in collect_endpoints(pm)}


def test_two_endpoints_on_one_path_are_refused():
    class Clash:
        @hookimpl
        def pagoda_register_protocols(self, register):
            clash = EchoEndpoint()
            clash.path = "/v1/messages"
            register(clash)

    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(Clash(), name="clash")
    with pytest.raises(PluginError, match="share the path '/v1/messages'"):
        collect_endpoints(pm)


def test_the_plugins_command_lists_plugins_hooks_and_origins(capsys, monkeypatch):
    monkeypatch.setenv("PAGODA_PLUGINS", "ollama")
    assert cli_main(["plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(listed) == set(BUILTIN_PLUGINS) | {"ollama"}
    assert listed["pagoda.plugins.builtin.disconnect_abort"]["provides"] == ["disconnect policy 'abort'"]
    assert listed["ollama"]["origin"].startswith("pagoda-ollama ")
    assert cli_main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "ollama  (pagoda-ollama" in text and "POST /api/chat (ollama-chat)" in text
