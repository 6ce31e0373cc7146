"""What a route plugin registers: an HTTP route that is not a generation endpoint.

A protocol Endpoint (pagoda/plugins/protocol.py) is a POST the server runs
through the engine. Anything else a plugin serves (the model list, a page) is
a `Route`: a method, a path and `make`, a factory the server calls once per
app with a `RouteContext` and that returns the async handler function. The
server, not the plugin, decorates the handler for Litestar, so what a route
needs from it is declared on the Route:

    guarded   behind --api-key when one is set (the guard answers 401)
    errors    the ErrorShape its errors are answered in: an exception the
              handler raises (RequestError for a status of its own) is
              rendered in it; None is the server's default, OpenAI's
    media_type  of what the handler returns (JSON unless it says otherwise)

The handler's own signature is read by Litestar, as for any handler: path
parameters by name, `request: Request` for the connection, and its return
annotation for the OpenAPI schema at /schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.plugins.protocol import ErrorShape, ServeContext


@dataclass(frozen=True)
class ServedModel:
    """The model a server serves, as the model cards describe it."""

    name: str  # --served-model-name, the id clients send
    created: int  # unix seconds: when the server was built
    max_model_len: int  # prompt + output tokens of one request
    aliases: tuple[str, ...] = ()  # more names clients may send for it (--served-model-name A B ...)
    architecture: Mapping[str, str] | None = None  # {"name": config's class, "plugin": the architecture plugin}
    # {"on": bool, "why": the path start-up proved, or why it is off, ...} (pagoda/model/invariance.py)
    batch_invariant: Mapping[str, Any] | None = None


def no_adapters(request: Any) -> Mapping[str, Mapping[str, Any]]:
    """A server that serves no LoRA adapters."""
    return {}


@dataclass(frozen=True)
class RouteContext:
    """What a route's handler is made from: the served model, its card, and the tokenizer and limits."""

    model: ServedModel
    card: Mapping[str, Any]  # the model's card: every plugin's pagoda_model_card fields, merged
    # resolve_model(request, name): the one check of a `model` a route is asked about, as the protocols check theirs
    # (pagoda.api.generation.served_model): (the name to report, the LoRA adapter it names or None for the base
    # model); a name neither served nor an adapter the caller may name raises a 404 RequestError (model_not_found)
    # naming what is served. `name` None is the base model.
    resolve_model: Callable[[Any, str | None], tuple[str, str | None]]
    serving: ServeContext | None = None  # what the protocols' prepare gets (None where no model is loaded)
    # adapters(request): the LoRA adapters the request's caller may name as its model, name -> the adapter's card
    # (the model's fields with its own id, `parent` the served name and `root` its path). Asked per request: they
    # are loaded and unloaded while the server runs, and a tenant may be limited to some of them.
    adapters: Callable[[Any], Mapping[str, Mapping[str, Any]]] = no_adapters


@dataclass(frozen=True)
class Route:
    """One HTTP route a plugin adds; `make(ctx)` returns its async handler."""

    method: str  # "GET", "POST", ...
    path: str  # Litestar's syntax, e.g. "/v1/models/{model_id:str}"
    make: Callable[[RouteContext], Callable[..., Any]]
    guarded: bool = True  # behind the API key when one is set
    errors: ErrorShape | None = None  # None: the server's default shape (OpenAI's)
    media_type: str = "application/json"  # of what the handler returns (and in the OpenAPI schema)

    @property
    def method_path(self) -> str:
        """E.g. "GET /v1/models": what `pagoda plugins` lists, unique across plugins."""
        return f"{self.method} {self.path}"
