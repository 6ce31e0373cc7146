"""LoRA adapters served as models: their cards, and the routes that load and unload them while serving.

An adapter loaded at start-up (`pagoda serve --lora-modules NAME=PATH`) or later through the routes below is a
model of its own: a request whose `model` names it runs with it (pagoda.api.generation.served_model, which also
keeps a tenant limited to some adapters from the others), and /v1/models lists it with `parent` the served
model's name (or the `base_model_name` --lora-modules gave it) and `root` its directory, as vLLM does
(`adapter_cards`, handed to the route plugins in their RouteContext).

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}       200 "Success: LoRA adapter 'x' added successfully."
                                                                   404 naming lora_path for a path that does not
                                                                   exist (vLLM's NotFoundError); 400 naming the
                                                                   field of any other refused adapter (its
                                                                   adapter_config.json field, tensor, lora_name or
                                                                   lora_path), or a name already served
    POST /v1/unload_lora_adapter  {"lora_name", "lora_int_id"?}    200 once the adapter's last request has ended;
                                                                   404 for a name that is not loaded

vLLM's routes and bodies (its `lora_int_id` is read and not needed: names are the ids here). They exist only
with `--enable-lora-loading` and answer in OpenAI's error shape. Loading or unloading changes what every tenant is
served, so on a server with keys only a key that may manage adapters may call them (`Tenant.manage_adapters`:
`--api-key`'s, and a keys file's tenants marked `"manage_adapters": true`); another key gets 403, no key 401.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec
from litestar import MediaType, Request, Response, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody
from litestar.types import Guard

from pagoda.api.body import STATE_KEY, strict_body_of
from pagoda.api.generation import Services, served_model, visible_adapters
from pagoda.api.http_errors import ERRORS_OPT
from pagoda.core.adapters import UnknownAdapter, check_adapter_name
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.request_fields import RequestError

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: AdapterName  # the model name requests will name it by
    lora_path: Annotated[str, msgspec.Meta(min_length=1)]  # a PEFT adapter directory on the server's disk


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    lora_name: AdapterName
    lora_int_id: int | None = None  # vLLM's numeric id; pagoda knows adapters by name only


def adapter_cards(services: Services, card_of: Callable[[str], Mapping[str, Any]],
                  parents: Mapping[str, str] | None = None) -> Callable[[Any], dict[str, dict[str, Any]]]:
    """`RouteContext.adapters`: the cards of the adapters a request's tenant may name, by name.

    `card_of(name)` is the served model's card made for another name (every plugin's fields); an adapter's card
    adds vLLM's `parent` (`parents[name]`, the `base_model_name` --lora-modules gave it, else the served name) and
    `root` (the adapter's directory). Each card is made once per loaded adapter (its `created` is when it was
    first listed)."""
    made: dict[tuple[str, str], dict[str, Any]] = {}
    parents = dict(parents or {})

    def cards(request: Any) -> dict[str, dict[str, Any]]:
        loaded = services.engine.adapters
        for key in [k for k in made if k[0] not in loaded]:  # unloaded: a reload is a new card
            del made[key]
        out = {}
        for name, info in visible_adapters(services, services.tenants.of(request)).items():
            key = (name, info.path)
            if key not in made:
                parent = parents.get(name, services.context.model_name)
                made[key] = {**card_of(name), "id": name, "parent": parent, "root": info.path}
            out[name] = made[key]
        return out

    return cards


def model_resolver(services: Services) -> Callable[[Any, str | None], tuple[str, str | None]]:
    """`RouteContext.resolve_model`: a route's `model` resolved as a generation request's is (served_model), for the
    request's tenant; a route never answers a name the server does not serve."""

    def resolve_model(request: Any, name: str | None) -> tuple[str, str | None]:
        return served_model(services, name, services.tenants.of(request))

    return resolve_model


def adapter_routes(services: Services, guards: list[Guard]) -> list[HTTPRouteHandler]:
    """POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (only with --enable-lora-loading)."""

    def may_manage(request: Request, name: str) -> None:
        """403 naming lora_name unless the caller's tenant may load and unload adapters."""
        if not services.tenants.of(request).manage_adapters:
            raise RequestError(f"this key may not load or unload LoRA adapters ({name!r}): its tenant is not "
                               f"marked manage_adapters", "lora_name", status=403, code="permission_denied")

    async def load_lora_adapter(request: Request, data: Any) -> Response[str]:
        """Load a PEFT LoRA adapter directory and serve it as the model `lora_name` (vLLM's route)."""
        body: LoadLoraAdapterRequest = getattr(request.state, STATE_KEY, data)
        name = body.lora_name
        may_manage(request, name)
        check_adapter_name(name, services.model_names or (services.context.model_name,))  # AdapterError: 400
        if not os.path.exists(body.lora_path):  # vLLM answers a path it cannot find with 404 (NotFoundError)
            raise RequestError(f"lora_path {body.lora_path!r} does not exist", "lora_path", status=404)
        await services.engine.load_adapter(name, body.lora_path)  # AdapterError: 400 naming its field (the engine logs)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type=MediaType.TEXT)

    async def unload_lora_adapter(request: Request, data: Any) -> Response[str]:
        """Stop serving the adapter `lora_name`: new requests for it get 404 at once, and the answer comes once its
        requests in flight have ended (vLLM's route)."""
        body: UnloadLoraAdapterRequest = getattr(request.state, STATE_KEY, data)
        name = body.lora_name
        may_manage(request, name)
        try:
            await services.engine.unload_adapter(name)
        except UnknownAdapter:
            raise RequestError(f"LoRA adapter {name!r} is not loaded", "lora_name", status=404,
                               code="model_not_found") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type=MediaType.TEXT)

    routes = []
    for path, handler, body_type in ((LOAD_PATH, load_lora_adapter, LoadLoraAdapterRequest),
                                     (UNLOAD_PATH, unload_lora_adapter, UnloadLoraAdapterRequest)):
        # the schema reads the body type from the annotation; the body is decoded strictly by before_request
        handler.__annotations__ = {"request": Request, "data": JSONBody[body_type], "return": Response[str]}
        # (the route's media type stays JSON, its errors'; the success answer says text/plain itself)
        routes.append(post(path, status_code=200, guards=guards, opt={ERRORS_OPT: OPENAI_ERRORS},
                           before_request=strict_body_of(body_type, OPENAI_ERRORS))(handler))
    return routes
