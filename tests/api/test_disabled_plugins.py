"""Each built-in plugin can be left out alone: the server starts, that plugin's routes are gone (404), its
other gifts (a policy, the tool parsers, card fields) too, and every other route still answers."""

from __future__ import annotations

import httpx
import pytest

from pagoda.model.config import ModelConfigError

from pagoda.api.settings import ServeSettings
from pagoda.plugins.manager import BUILTIN_ARCHITECTURES, BUILTIN_PLUGINS, collect_endpoints, collect_routes, load_plugins
from tests.server_fixtures import TINY_ENGINE, TINY_NAME, start_server

USER = [{"role": "user", "content": "Hi"}]
# every built-in route, with a request it answers 200 (a small generation for the four protocols)
PROBES = {
    "POST /v1/completions": {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2},
    "POST /v1/chat/completions": {"model": TINY_NAME, "messages": USER, "max_tokens": 2},
    "POST /v1/responses": {"model": TINY_NAME, "input": "Hi", "max_output_tokens": 2},
    "POST /v1/messages": {"model": TINY_NAME, "messages": USER, "max_tokens": 2},
    "POST /v1/messages/count_tokens": {"model": TINY_NAME, "messages": USER},
    "GET /v1/models": None,
    f"GET /v1/models/{TINY_NAME}": None,
    "POST /tokenize": {"prompt": "Hi"},
    "POST /detokenize": {"tokens": [1, 2]},
    "GET /": None,
    "GET /health": None,
    "GET /metrics": None,
}
TOOLS = {"model": TINY_NAME, "messages": USER, "max_tokens": 2,
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


def routes_of(name: str) -> set[str]:
    """The probes of the routes (and endpoints) plugin `name` registers."""
    alone = load_plugins({"PAGODA_PLUGINS": "none"}, disabled=[n for n in BUILTIN_PLUGINS if n != name])
    paths = {f"POST {e.path}" for e in collect_endpoints(alone)}
    paths |= {r.method_path.replace("{model_id:str}", TINY_NAME) for r in collect_routes(alone)}
    return {probe for probe in PROBES if probe in paths}


def ask(http: httpx.Client, probe: str) -> httpx.Response:
    method, path = probe.split(" ", 1)
    return http.request(method, path, json=PROBES[probe]) if PROBES[probe] is not None else http.request(method, path)


ARCHITECTURES = sorted(BUILTIN_ARCHITECTURES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(BUILTIN_PLUGINS) - {"scheduling_policies"}))
def test_each_builtin_can_be_left_out_alone(name, tiny_model_dir):
    settings = ServeSettings(disabled_plugins=(name,),
                             disconnect_policy="finish" if name == "disconnect_abort" else "abort",
                             tool_parser=None if name == "tool_parsers" else "hermes")
    live = start_server(tiny_model_dir, TINY_NAME, settings=settings, environ={"PAGODA_PLUGINS": "none"},
                        **TINY_ENGINE)
    try:
        gone = routes_of(name)
        assert gone or name in ("disconnect_abort", "disconnect_finish", "tool_parsers"), name  # the test bites
        with live.http() as http:
            for probe in PROBES:
                response = ask(http, probe)
                want = 404 if probe in gone else 200
                assert response.status_code == want, f"{name} left out: {probe} -> {response.status_code}"
            card = http.get("/v1/models").json()["data"][0] if "GET /v1/models" not in gone else {}
            tools = http.post("/v1/chat/completions", json=TOOLS)
        if name == "tool_parsers":
            assert tools.status_code == 400 and "no tool parser" in tools.json()["error"]["message"]
        elif name != "openai_chat":
            assert tools.status_code == 200
        if name == "anthropic_messages":
            assert "display_name" not in card and card["object"] == "model"
        live.assert_pool_whole()
    finally:
        live.server.stop()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_an_architecture_left_out_is_one_the_server_cannot_load(name, tiny_model_dir):
    """The tiny model is a Llama: without the llama plugin it is refused by name; without any other, it serves."""
    settings = ServeSettings(disabled_plugins=(name,))
    if name == "llama":
        with pytest.raises(ModelConfigError, match=r"'architectures' = \['LlamaForCausalLM'\] is not supported"):
            start_server(tiny_model_dir, TINY_NAME, settings=settings, environ={"PAGODA_PLUGINS": "none"}, **TINY_ENGINE)
        return
    live = start_server(tiny_model_dir, TINY_NAME, settings=settings, environ={"PAGODA_PLUGINS": "none"}, **TINY_ENGINE)
    try:
        with live.http() as http:
            assert http.get("/v1/models").json()["data"][0]["architecture"] == {"name": "LlamaForCausalLM",
                                                                               "plugin": "llama"}
    finally:
        live.server.stop()


def test_without_the_scheduling_policies_plugin_no_server_starts(tiny_model_dir):
    """Even fcfs is a plugin's: left out, the server refuses to start and says which plugin is missing."""
    settings = ServeSettings(disabled_plugins=("scheduling_policies",))
    with pytest.raises(ValueError, match="scheduling policy 'fcfs': no scheduling policy is registered"):
        start_server(tiny_model_dir, TINY_NAME, settings=settings, environ={"PAGODA_PLUGINS": "none"}, **TINY_ENGINE)


def test_a_setting_that_names_a_left_out_plugin_is_refused_at_start(tiny_model_dir):
    for settings, why in ((ServeSettings(disabled_plugins=("disconnect_abort",)), "disconnect_policy 'abort'"),
                          (ServeSettings(disabled_plugins=("tool_parsers",)), "tool_parser 'hermes'")):
        with pytest.raises(ValueError, match=why):
            start_server(tiny_model_dir, TINY_NAME, settings=settings, **TINY_ENGINE)
