"""Loading plugins: pagoda's built-in ones and installed packages', through one registry.

Built-in features are plugin modules listed in BUILTIN_PLUGINS and registered
exactly as a third-party package's plugin is; they have no private path into
the server. Third-party plugins are packages declaring an entry point in the
group `pagoda`, e.g. in their pyproject.toml:

    [project.entry-points.pagoda]
    ollama = "pagoda_ollama"

Which third-party plugins load is decided by the environment variable
PAGODA_PLUGINS, read only by `load_plugins`:

    unset              every installed plugin
    "none" or ""       none (only the built-in ones)
    "a,b"              only the entry points named a and b; naming one that is
                       not installed is an error, not a silent omission
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from importlib import metadata

import pluggy

from pagoda.plugins import hookspecs
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.protocol import Endpoint
from pagoda.plugins.route import Route, ServedModel
from pagoda.plugins.tools import ToolParser

BUILTIN_PLUGINS = (
    "pagoda.plugins.builtin.openai_common",  # the OpenAI family's model card fields
    "pagoda.plugins.builtin.openai_completions",
    "pagoda.plugins.builtin.openai_chat",
    "pagoda.plugins.builtin.openai_responses",
    "pagoda.plugins.builtin.anthropic_messages",
    "pagoda.plugins.builtin.disconnect_abort",
    "pagoda.plugins.builtin.disconnect_finish",
    "pagoda.plugins.builtin.models",
    "pagoda.plugins.builtin.tokenize",  # POST /tokenize, /detokenize, /v1/messages/count_tokens
    "pagoda.plugins.builtin.chat_page",
    "pagoda.plugins.builtin.tool_parsers",
)
ENTRY_POINT_GROUP = "pagoda"
ALLOW_ENV = "PAGODA_PLUGINS"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or two plugins claim the same name, route or card field."""


def new_manager() -> pluggy.PluginManager:
    """An empty plugin manager that knows pagoda's hooks."""
    pm = pluggy.PluginManager("pagoda")
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(environ: Mapping[str, str] | None = None) -> pluggy.PluginManager:
    """A manager with the built-in plugins and the third-party ones PAGODA_PLUGINS allows."""
    environ = os.environ if environ is None else environ
    pm = new_manager()
    for name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    allow = environ.get(ALLOW_ENV)
    if allow is None:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        return pm
    names = [n.strip() for n in allow.split(",") if n.strip()]
    if names == ["none"]:
        return pm
    installed = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    missing = [n for n in names if n not in installed]
    if missing:
        raise PluginError(
            f"{ALLOW_ENV} names plugin(s) that are not installed: {', '.join(missing)}"
            f" (installed: {', '.join(sorted(installed)) or 'none'})"
        )
    for name in names:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    return pm


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, for `pagoda plugins`."""

    name: str
    origin: str  # "built-in", or "<distribution> <version>"
    hooks: tuple[str, ...]
    provides: tuple[str, ...] = ()  # what its registration hooks register, in words


def describe_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """Every registered plugin with its hooks and where it comes from."""
    distributions = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    provides = _registrations(pm)
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))
        dist = distributions.get(id(plugin))
        if dist is not None:
            origin = f"{dist.project_name} {dist.version}"
        elif name in BUILTIN_PLUGINS:
            origin = "built-in"
        else:
            origin = "registered in code"
        infos.append(PluginInfo(name=name, origin=origin, hooks=hooks, provides=tuple(provides.get(name, ()))))
    return infos


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
