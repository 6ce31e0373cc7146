"""GET /v1/models and GET /v1/models/{model_id}: the served model's card, for the openai and anthropic SDKs.

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

from litestar.params import FromPath

from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import Route, RouteContext, ServedModel


def make_list(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of GET /v1/models: one page holding the served model's card."""
    name = ctx.model.name

    async def list_models() -> dict[str, Any]:
        """The models this server serves: one."""
        return {"object": "list", "data": [dict(ctx.card)], "has_more": False, "first_id": name, "last_id": name}

    return list_models


def make_retrieve(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of GET /v1/models/{model_id}: the card, or a 404 naming the served model."""

    async def retrieve_model(model_id: FromPath[str]) -> dict[str, Any]:
        """The served model's card; any other id is not found."""
        if model_id != ctx.model.name and model_id not in ctx.model.aliases:
            raise RequestError(f"model {model_id!r} does not exist; this server serves {ctx.model.name!r}",
                               "model", status=404, code="model_not_found")
        return {**ctx.card, "id": model_id}  # an alias is reported as the name asked for

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
