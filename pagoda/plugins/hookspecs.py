"""The hooks a pagoda plugin can implement.

A plugin is a module (or any object) with functions decorated `@hookimpl`,
registered from pagoda's built-in list or from a package's entry point in the
group `pagoda`. Registration hooks take a `register` callback, so a plugin
can add several things, or none.

A protocol's own steps (body -> engine request, unary body, stream events,
error body) are the methods of the `Endpoint` it registers
(pagoda/plugins/protocol.py), not hooks: hooks are called on every plugin,
while each of those steps belongs to exactly one route. Routes that are not
generation endpoints (the model list, the chat page) are `Route`s
(pagoda/plugins/route.py), built by the server from a RouteContext.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from pagoda.core.scheduling import SchedulingPolicy
    from pagoda.plugins.architecture import Architecture
    from pagoda.plugins.disconnect import DisconnectPolicy
    from pagoda.plugins.protocol import Endpoint
    from pagoda.plugins.route import Route, ServedModel
    from pagoda.plugins.tools import ToolParser

hookspec = HookspecMarker("pagoda")
hookimpl = HookimplMarker("pagoda")


@hookspec
def pagoda_register_protocols(register: Callable[[Endpoint], None]) -> None:
    """Register protocol endpoints (an HTTP route each: body type, engine request, rendering)."""


@hookspec
def pagoda_register_disconnect_policies(register: Callable[[DisconnectPolicy], None]) -> None:
    """Register policies for a request whose client went away (chosen by --disconnect-policy)."""


@hookspec
def pagoda_register_routes(register: Callable[[Route], None]) -> None:
    """Register HTTP routes that are not generation endpoints (a listing, a page), each a Route."""


@hookspec
def pagoda_register_tool_parsers(register: Callable[[ToolParser], None]) -> None:
    """Register tool-call parsers (a model family's call syntax; chosen by --tool-parser)."""


@hookspec
def pagoda_register_architectures(register: Callable[[Architecture], None]) -> None:
    """Register model architectures (a family's config parsing, module, weight names and GGUF layout)."""


@hookspec
def pagoda_register_scheduling_policies(register: Callable[[type[SchedulingPolicy]], None]) -> None:
    """Register scheduling policy classes (pagoda.core.scheduling; chosen by --scheduling-policy by their `name`)."""


@hookspec
def pagoda_model_card(model: ServedModel) -> dict[str, Any] | None:
    """Fields this plugin's protocol family adds to the served model's card (GET /v1/models); merged."""
