"""Loading plugins: pagoda's built-in ones and installed packages', through one registry.

Built-in features are plugin modules listed in BUILTIN_PLUGINS and registered
exactly as a third-party package's plugin is; they have no private path into
the server, and none imports another (what two share is in the plugin
interface), so each can be left out alone. The model families are built-in
plugins of the model room (pagoda.model.families): named here, in
BUILTIN_ARCHITECTURES, so that any process can leave one out by name, and
registered by the model room when a model is built, so that loading the
plugins imports no model and no torch (the router loads them to know the
protocols' paths). Third-party plugins are packages declaring an entry point
in the group `pagoda`, e.g. in their pyproject.toml:

    [project.entry-points.pagoda]
    ollama = "pagoda_ollama"

Which third-party plugins load is decided by the environment variable
PAGODA_PLUGINS, read only by `load_plugins`:

    unset              every installed plugin
    "none" or ""       none (only the built-in ones)
    "a,b"              only the entry points named a and b; naming one that is
                       not installed is an error, not a silent omission

Any plugin, built-in or installed, can be left out by name: `disabled`
(`pagoda serve --disable-plugin NAME...`) and the environment variable
PAGODA_DISABLE_PLUGINS ("a,b"), in the spirit of simonw/llm's
LLM_LOAD_PLUGINS. A disabled name is blocked in the registry, so `pagoda
plugins` lists it as disabled; naming a plugin that does not exist is an error.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from pagoda.core.scheduling import SchedulingPolicy
from pagoda.plugins import hookspecs
from pagoda.plugins.architecture import Architecture
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.protocol import Endpoint
from pagoda.plugins.route import Route, ServedModel
from pagoda.plugins.tools import ToolParser

# name -> module; the name is what `pagoda plugins` lists and --disable-plugin takes
BUILTIN_PLUGINS = {
    "openai_completions": "pagoda.plugins.builtin.openai_completions",  # POST /v1/completions
    "openai_chat": "pagoda.plugins.builtin.openai_chat",  # POST /v1/chat/completions
    "openai_responses": "pagoda.plugins.builtin.openai_responses",  # POST /v1/responses
    "anthropic_messages": "pagoda.plugins.builtin.anthropic_messages",  # POST /v1/messages (+ count_tokens)
    "disconnect_abort": "pagoda.plugins.builtin.disconnect_abort",
    "disconnect_finish": "pagoda.plugins.builtin.disconnect_finish",
    "models": "pagoda.plugins.builtin.models",  # GET /v1/models
    "tokenize": "pagoda.plugins.builtin.tokenize",  # POST /tokenize, /detokenize
    "chat_page": "pagoda.plugins.builtin.chat_page",  # GET /
    "tool_parsers": "pagoda.plugins.builtin.tool_parsers",  # hermes, llama3_json
    "scheduling_policies": "pagoda.plugins.builtin.scheduling_policies",  # fcfs, priority, fair
}
# The model families, each a plugin module of the model room built from pagoda's layers
# (pagoda/model/families/<name>.py), registered there by pagoda.model.families.register_families.
BUILTIN_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe")
ENTRY_POINT_GROUP = "pagoda"
ALLOW_ENV = "PAGODA_PLUGINS"
DISABLE_ENV = "PAGODA_DISABLE_PLUGINS"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or two plugins claim the same name, route or card field."""


def new_manager() -> pluggy.PluginManager:
    """An empty plugin manager that knows pagoda's hooks."""
    pm = pluggy.PluginManager("pagoda")
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(environ: Mapping[str, str] | None = None, disabled: Iterable[str] = ()) -> pluggy.PluginManager:
    """A manager with the built-in plugins and the third-party ones PAGODA_PLUGINS allows, less the disabled ones
    (`disabled` and PAGODA_DISABLE_PLUGINS)."""
    environ = os.environ if environ is None else environ
    pm = new_manager()
    installed = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for name in disabled_names(environ, disabled, installed):
        pm.set_blocked(name)  # registering it is then a no-op; `pagoda plugins` lists it as disabled
    for name, module in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module), name=name)
    allow = environ.get(ALLOW_ENV)
    if allow is None:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        return pm
    names = _names(allow)
    if names == ["none"]:
        return pm
    missing = [n for n in names if n not in installed]
    if missing:
        raise PluginError(
            f"{ALLOW_ENV} names plugin(s) that are not installed: {', '.join(missing)}"
            f" (installed: {', '.join(sorted(installed)) or 'none'})"
        )
    for name in names:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    return pm


def disabled_names(environ: Mapping[str, str], disabled: Iterable[str], installed: Iterable[str] = ()) -> list[str]:
    """The plugins to leave out: `disabled` and PAGODA_DISABLE_PLUGINS; a name no plugin has is an error."""
    names = list(dict.fromkeys([*disabled, *_names(environ.get(DISABLE_ENV, ""))]))
    known = set(BUILTIN_PLUGINS) | set(BUILTIN_ARCHITECTURES) | set(installed)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PluginError(f"cannot disable {', '.join(map(repr, unknown))}: no plugin has that name"
                          f" (plugins: {', '.join(sorted(known))})")
    return names


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


@dataclass(frozen=True)
class PluginInfo:
    """One plugin, registered or disabled, for `pagoda plugins`."""

    name: str
    origin: str  # "built-in", "<distribution> <version>", "installed" (a disabled entry point) or "registered in code"
    hooks: tuple[str, ...]
    provides: tuple[str, ...] = ()  # what its registration hooks register, in words
    disabled: bool = False  # left out (--disable-plugin, PAGODA_DISABLE_PLUGINS): registered nothing


def describe_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """Every registered plugin with its hooks and where it comes from."""
    distributions = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    provides = _registrations(pm)
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked: disabled by name
            infos.append(PluginInfo(name=name, origin="built-in" if _is_builtin(name) else "installed",
                                    hooks=(), disabled=True))
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))
        dist = distributions.get(id(plugin))
        if dist is not None:
            origin = f"{dist.project_name} {dist.version}"
        elif _is_builtin(name):
            origin = "built-in"
        else:
            origin = "registered in code"
        infos.append(PluginInfo(name=name, origin=origin, hooks=hooks, provides=tuple(provides.get(name, ()))))
    return infos


def _is_builtin(name: str) -> bool:
    """Whether `name` is one of pagoda's own plugins (the plugin interface's or a model family)."""
    return name in BUILTIN_PLUGINS or name in BUILTIN_ARCHITECTURES


def _registrations(pm: pluggy.PluginManager) -> dict[str, list[str]]:
    """Plugin name -> what each of its registration and card hooks gives (each impl called on its own)."""
    found: dict[str, list[str]] = {}
    for impl in pm.hook.pagoda_register_protocols.get_hookimpls():
        endpoints: list[Endpoint] = []
        impl.function(register=endpoints.append)
        found.setdefault(impl.plugin_name, []).extend(f"POST {e.path} ({e.name})" for e in endpoints)
    for impl in pm.hook.pagoda_register_disconnect_policies.get_hookimpls():
        policies: list[DisconnectPolicy] = []
        impl.function(register=policies.append)
        found.setdefault(impl.plugin_name, []).extend(f"disconnect policy {p.name!r}" for p in policies)
    for impl in pm.hook.pagoda_register_routes.get_hookimpls():
        routes: list[Route] = []
        impl.function(register=routes.append)
        found.setdefault(impl.plugin_name, []).extend(r.method_path for r in routes)
    for impl in pm.hook.pagoda_register_tool_parsers.get_hookimpls():
        parsers: list[ToolParser] = []
        impl.function(register=parsers.append)
        found.setdefault(impl.plugin_name, []).extend(f"tool parser {p.name!r}" for p in parsers)
    for impl in pm.hook.pagoda_register_architectures.get_hookimpls():
        archs: list[Architecture] = []
        impl.function(register=archs.append)
        found.setdefault(impl.plugin_name, []).extend(
            f"architecture {a.name!r} ({', '.join(a.hf_architectures)})" for a in archs)
    for impl in pm.hook.pagoda_register_scheduling_policies.get_hookimpls():
        classes: list[type[SchedulingPolicy]] = []
        impl.function(register=classes.append)
        found.setdefault(impl.plugin_name, []).extend(f"scheduling policy {c.name!r}" for c in classes)
    for impl in pm.hook.pagoda_model_card.get_hookimpls():
        fields = impl.function(model=ServedModel(name="model", created=0, max_model_len=0)) or {}
        found.setdefault(impl.plugin_name, []).append(f"model card fields: {', '.join(fields)}")
    return found


def collect_endpoints(pm: pluggy.PluginManager) -> list[Endpoint]:
    """Every protocol endpoint the plugins register; two on one path or name is an error."""
    endpoints: list[Endpoint] = []
    pm.hook.pagoda_register_protocols(register=endpoints.append)
    _check_unique(endpoints, "path", "protocol endpoints")
    _check_unique(endpoints, "name", "protocol endpoints")
    return endpoints


def collect_disconnect_policies(pm: pluggy.PluginManager) -> dict[str, DisconnectPolicy]:
    """Every disconnect policy the plugins register, by name."""
    policies: list[DisconnectPolicy] = []
    pm.hook.pagoda_register_disconnect_policies(register=policies.append)
    _check_unique(policies, "name", "disconnect policies")
    return {p.name: p for p in policies}


def collect_tool_parsers(pm: pluggy.PluginManager) -> dict[str, ToolParser]:
    """Every tool-call parser the plugins register, by name."""
    parsers: list[ToolParser] = []
    pm.hook.pagoda_register_tool_parsers(register=parsers.append)
    _check_unique(parsers, "name", "tool parsers")
    return {p.name: p for p in parsers}


def collect_scheduling_policies(pm: pluggy.PluginManager) -> dict[str, type[SchedulingPolicy]]:
    """Every scheduling policy class the plugins register, by name; two with one name is an error."""
    classes: list[type[SchedulingPolicy]] = []
    pm.hook.pagoda_register_scheduling_policies(register=classes.append)
    _check_unique(classes, "name", "scheduling policies")
    return {c.name: c for c in classes}


def collect_architectures(pm: pluggy.PluginManager) -> list[Architecture]:
    """Every architecture the plugins register (the built-in families once pagoda.model.families.register_families
    has put them on `pm`); two with one name, or claiming one config name, is an error."""
    archs: list[Architecture] = []
    pm.hook.pagoda_register_architectures(register=archs.append)
    _check_unique(archs, "name", "architectures")
    claimed: dict[str, str] = {}
    for arch in archs:
        for key in (*arch.hf_architectures, *(f"model_type {t}" for t in arch.model_types)):
            if key in claimed:
                raise PluginError(f"architectures {claimed[key]!r} and {arch.name!r} both claim {key!r}")
            claimed[key] = arch.name
    return archs


def collect_routes(pm: pluggy.PluginManager) -> list[Route]:
    """Every route the plugins register; two with one method and path is an error."""
    routes: list[Route] = []
    pm.hook.pagoda_register_routes(register=routes.append)
    _check_unique(routes, "method_path", "routes")
    return routes


def collect_model_card(pm: pluggy.PluginManager, model: ServedModel) -> dict[str, Any]:
    """The served model's card: every plugin's fields in registration order; a field given two values is an error."""
    card: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for impl in pm.hook.pagoda_model_card.get_hookimpls():  # in registration order (a call would be the reverse)
        for key, value in (impl.function(model=model) or {}).items():
            if key in card and card[key] != value:
                raise PluginError(f"plugins {owner[key]!r} and {impl.plugin_name!r} give the model card field"
                                  f" {key!r} two values: {card[key]!r} and {value!r}")
            card[key], owner[key] = value, impl.plugin_name
    return card


def _check_unique(items: list, attr: str, what: str) -> None:
    seen: dict[str, object] = {}
    for item in items:
        key = getattr(item, attr)
        if key in seen:
            raise PluginError(f"two {what} share the {attr} {key!r}: {seen[key]!r} and {item!r}")
        seen[key] = item


def endpoints_by_protocol(endpoints: Iterable[Endpoint]) -> dict[str, Endpoint]:
    """The endpoints by the protocol name crowds use ("chat", "ollama-chat"); two with one name is an error."""
    found: dict[str, Endpoint] = {}
    for endpoint in endpoints:
        if endpoint.protocol in found:
            raise ValueError(f"two endpoints share the protocol name {endpoint.protocol!r}:"
                             f" {found[endpoint.protocol].name} and {endpoint.name}")
        found[endpoint.protocol] = endpoint
    return found


def registered_endpoints(pm: pluggy.PluginManager) -> dict[str, Endpoint]:
    """The endpoints a plugin manager's plugins register, by protocol name (what clients of the server iterate)."""
    return endpoints_by_protocol(collect_endpoints(pm))
