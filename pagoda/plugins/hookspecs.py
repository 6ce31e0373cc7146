"""The hooks a pagoda plugin can implement.

A plugin is a module (or any object) with functions decorated `@hookimpl`,
registered from pagoda's built-in list or from a package's entry point in the
group `pagoda`. Registration hooks take a `register` callback, so a plugin
can add several things, or none.

A protocol's own steps (body -> engine request, unary body, stream events,
error body) are the methods of the `Endpoint` it registers
(pagoda/plugins/protocol.py), not hooks: hooks are called on every plugin,
while each of those steps belongs to exactly one route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from pagoda.plugins.disconnect import DisconnectPolicy
    from pagoda.plugins.protocol import Endpoint

hookspec = HookspecMarker("pagoda")
hookimpl = HookimplMarker("pagoda")


@hookspec
def pagoda_register_protocols(register: Callable[[Endpoint], None]) -> None:
    """Register protocol endpoints (an HTTP route each: body type, engine request, rendering)."""


@hookspec
def pagoda_register_disconnect_policies(register: Callable[[DisconnectPolicy], None]) -> None:
    """Register policies for a request whose client went away (chosen by --disconnect-policy)."""
