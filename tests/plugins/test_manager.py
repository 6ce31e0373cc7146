"""The plugin system: built-ins registered like third-party plugins, entry points, the allow-list."""

import json
from importlib import metadata

import httpx
import pytest
from litestar.params import FromPath

from pagoda.api.app import create_app
from pagoda.api.server import BackgroundServer
from pagoda.api.settings import ServeSettings
from pagoda.cli.main import main as cli_main
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins import hookimpl
from pagoda.plugins.builtin.disconnect_abort import AbortOnDisconnect
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.manager import (
    BUILTIN_ARCHITECTURES,
    BUILTIN_PLUGINS,
    PluginError,
    collect_disconnect_policies,
    collect_endpoints,
    collect_model_card,
    collect_routes,
    describe_plugins,
    load_plugins,
)
from pagoda.plugins.protocol import Endpoint, ErrorShape
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import Route, ServedModel
from tests.helpers import fake_engine

BUILTIN_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
BUILTIN_ROUTES = {"GET /", "GET /v1/models", "GET /v1/models/{model_id:str}", "POST /tokenize", "POST /detokenize",
                  "POST /v1/messages/count_tokens"}


def test_builtin_plugins_provide_the_four_protocols_and_the_abort_policy():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    assert [name for name, _ in pm.list_name_plugin()] == list(BUILTIN_PLUGINS)
    assert {e.path for e in collect_endpoints(pm)} == BUILTIN_PATHS
    policies = collect_disconnect_policies(pm)
    assert sorted(policies) == ["abort", "finish"] and isinstance(policies["abort"], AbortOnDisconnect)
    infos = {i.name: i for i in describe_plugins(pm)}
    assert infos["openai_chat"].origin == "built-in"
    assert infos["openai_chat"].hooks == ("pagoda_model_card", "pagoda_register_protocols")
    assert infos["openai_chat"].provides == ("POST /v1/chat/completions (openai-chat)",
                                             "model card fields: id, object, created, owned_by")
    assert {r.method_path for r in collect_routes(pm)} == BUILTIN_ROUTES
    assert infos["models"].provides == (
        "GET /v1/models", "GET /v1/models/{model_id:str}", "model card fields: max_model_len")
    assert infos["chat_page"].provides == ("GET /",)
    assert infos["anthropic_messages"].provides[:2] == ("POST /v1/messages (anthropic-messages)",
                                                        "POST /v1/messages/count_tokens")


def test_each_protocol_family_adds_its_own_fields_to_the_model_card():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    card = collect_model_card(pm, ServedModel(name="m", created=1_700_000_000, max_model_len=512))
    assert card == {"id": "m", "object": "model", "created": 1_700_000_000, "owned_by": "pagoda",  # OpenAI's
                    "type": "model", "display_name": "m", "created_at": "2023-11-14T22:13:20Z",  # Anthropic's
                    "max_model_len": 512}  # pagoda's
    infos = {i.name: i for i in describe_plugins(pm)}
    for name in ("openai_completions", "openai_chat", "openai_responses"):  # each can be left out alone
        assert "model card fields: id, object, created, owned_by" in infos[name].provides
    assert "model card fields: id, type, display_name, created_at" in infos["anthropic_messages"].provides


def test_two_plugins_giving_one_card_field_two_values_are_refused():
    class Liar:
        @hookimpl
        def pagoda_model_card(self, model):
            return {"owned_by": "someone else"}

    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(Liar(), name="liar")
    with pytest.raises(PluginError, match="'owned_by' two values: 'pagoda' and 'someone else'"):
        collect_model_card(pm, ServedModel(name="m", created=0, max_model_len=1))


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


class TeapotErrors(ErrorShape):
    def render_error(self, error):
        return {"teapot": error.message, "status": error.status}


def _whoami(ctx):
    async def whoami(request_id: FromPath[int]) -> dict:
        """The served model's name, or a refusal of odd ids in the route's own shape."""
        if request_id % 2:
            raise RequestError(f"odd id {request_id}", "request_id", status=418)
        return {"model": ctx.model.name, "card_id": ctx.card["id"], "request_id": request_id}

    return whoami


class RoutePlugin:
    @hookimpl
    def pagoda_register_routes(self, register):
        register(Route("GET", "/whoami/{request_id:int}", _whoami, errors=TeapotErrors()))


def test_a_plugin_route_is_served_with_its_context_its_guard_and_its_error_shape():
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(RoutePlugin(), name="routes")
    try:
        assert {i.name: i for i in describe_plugins(pm)}["routes"].provides == ("GET /whoami/{request_id:int}",)
        settings = ServeSettings(served_model_name="served", api_key="sekret")
        with BackgroundServer(create_app(AsyncEngine(fake_engine()), None, pm, settings)) as server:
            key = {"Authorization": "Bearer sekret"}
            r = httpx.get(f"{server.url}/whoami/4", headers=key, timeout=60)
            assert r.status_code == 200 and r.json() == {"model": "served", "card_id": "served", "request_id": 4}
            r = httpx.get(f"{server.url}/whoami/3", headers=key, timeout=60)
            assert r.status_code == 418 and r.json() == {"teapot": "odd id 3", "status": 418}
            r = httpx.get(f"{server.url}/whoami/4", timeout=60)  # guarded: the API key is checked first
            assert r.status_code == 401 and "API key" in r.json()["teapot"]
            assert httpx.get(f"{server.url}/", timeout=60).status_code == 200  # the chat page is open
            assert httpx.get(f"{server.url}/v1/models", timeout=60).status_code == 401
    finally:
        pm.unregister(name="routes")


def test_two_routes_on_one_method_and_path_are_refused():
    class Clash:
        @hookimpl
        def pagoda_register_routes(self, register):
            register(Route("GET", "/v1/models", _whoami))

    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(Clash(), name="clash")
    with pytest.raises(PluginError, match="two routes share the method_path 'GET /v1/models'"):
        collect_routes(pm)


def test_the_plugins_command_lists_plugins_hooks_and_origins(capsys, monkeypatch):
    monkeypatch.setenv("PAGODA_PLUGINS", "ollama")
    assert cli_main(["plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(listed) == set(BUILTIN_PLUGINS) | set(BUILTIN_ARCHITECTURES) | {"ollama"}
    assert listed["disconnect_abort"]["provides"] == ["disconnect policy 'abort'"]
    assert listed["ollama"]["origin"].startswith("pagoda-ollama ")
    assert cli_main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "ollama  (pagoda-ollama" in text and "POST /api/chat (ollama-chat)" in text
    assert "    GET /v1/models/{model_id:str}" in text and "    GET /\n" in text


def test_plugins_are_left_out_by_name_and_listed_as_disabled(capsys, monkeypatch):
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "ollama, chat_page")
    pm = load_plugins(disabled=["tokenize"])
    assert not {"tokenize", "chat_page", "ollama"} & {name for name, plugin in pm.list_name_plugin() if plugin}
    assert {r.method_path for r in collect_routes(pm)} == BUILTIN_ROUTES - {"GET /", "POST /tokenize",
                                                                            "POST /detokenize"}
    assert cli_main(["plugins", "--json", "--disable-plugin", "models"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert {n for n, p in listed.items() if p["disabled"]} == {"models", "chat_page", "ollama"}
    assert listed["ollama"]["origin"] == "installed" and listed["models"]["origin"] == "built-in"
    assert cli_main(["plugins"]) == 0
    assert "chat_page  (built-in, disabled)" in capsys.readouterr().out


def test_disabling_a_plugin_that_does_not_exist_is_an_error(monkeypatch):
    with pytest.raises(PluginError, match="cannot disable 'nope': no plugin has that name"):
        load_plugins({}, disabled=["nope"])
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "nope")
    with pytest.raises(SystemExit, match="no plugin has that name"):
        cli_main(["plugins"])
