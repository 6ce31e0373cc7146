"""GET /v1/models and GET /v1/models/{model_id}: the served model's card, for the openai and anthropic SDKs.

Each LoRA adapter the caller may name (`RouteContext.adapters`) is listed after the model as a model of its
own, in vLLM's shape: its card is the model's fields under its own id, with `parent` the served model's name
and `root` the adapter's directory.

The card is not written here: each protocol family adds its own fields through
the `pagoda_model_card` hook (OpenAI's id/object/created/owned_by from each
OpenAI endpoint, Anthropic's id/type/display_name/created_at from
anthropic_messages), and the server merges them into `RouteContext.card`.
This plugin adds pagoda's own `max_model_len` and `architecture` and serves the card. The list
envelope is read by both SDKs: OpenAI's reads `object` and `data`, Anthropic's
pages with `has_more`, `first_id` and `last_id`. The routes are OpenAI's in
origin, so their errors are in OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request
from litestar.params import FromPath

from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import Route, RouteContext, ServedModel


def make_list(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of GET /v1/models: one page holding the served model's card, then its adapters'."""
    name = ctx.model.name

    async def list_models(request: Request) -> dict[str, Any]:
        """The models this server serves: the model, then each LoRA adapter the caller may name."""
        adapters = ctx.adapters(request)
        return {"object": "list", "data": [dict(ctx.card), *map(dict, adapters.values())], "has_more": False,
                "first_id": name, "last_id": list(adapters)[-1] if adapters else name}

    return list_models


def make_retrieve(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of GET /v1/models/{model_id}: the card, or a 404 naming the served model."""

    async def retrieve_model(model_id: FromPath[str], request: Request) -> dict[str, Any]:
        """The served model's card, or a LoRA adapter's; any other id is not found."""
        reported, adapter = ctx.resolve_model(request, model_id)  # 404 for a model not served
        if adapter is None:
            return {**ctx.card, "id": reported}  # an alias is reported as the name asked for
        card = ctx.adapters(request).get(adapter)
        if card is None:  # unloaded since it was resolved
            raise RequestError(f"model {model_id!r} does not exist (the LoRA adapter was just unloaded)", "model",
                               status=404, code="model_not_found")
        return dict(card)

    return retrieve_model


@hookimpl
def pagoda_register_routes(register):
    register(Route("GET", "/v1/models", make_list, errors=OPENAI_ERRORS))
    register(Route("GET", "/v1/models/{model_id:str}", make_retrieve, errors=OPENAI_ERRORS))


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """pagoda's own fields: the context length of one request (as vLLM reports it), which architecture
    (config class and plugin) serves, and whether answers are batch invariant (and how start-up proved it)."""
    card: dict[str, Any] = {"max_model_len": model.max_model_len}
    if model.architecture:
        card["architecture"] = dict(model.architecture)
    if model.batch_invariant:
        card["batch_invariant"] = dict(model.batch_invariant)
    return card
