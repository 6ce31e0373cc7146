"""The Litestar application: protocol endpoints and routes from the plugins, health, metrics, auth, OpenAPI.

`create_app` bridges the plugin registry to Litestar: every Endpoint that a
plugin registers becomes a POST route running the shared handler in
pagoda.api.generation, and every Route (pagoda/plugins/route.py) a handler
made from one RouteContext, with the API key guard and the error shape it
declares. The OpenAPI schema of all of them is served at /schema (JSON, as at
/schema/openapi.json) and drawn by Swagger UI at /schema/swagger, whose
scripts come from a CDN. The app owns the engine loop's lifetime: it starts
the loop at start-up and stops it at shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pluggy
from litestar import Litestar, route
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.types import Guard

from pagoda import __version__
from pagoda.api.access_log import access_log_middleware
from pagoda.api.adapters import adapter_cards, adapter_routes, model_resolver
from pagoda.api.errors import handle_exception
from pagoda.api.generation import Services, endpoint_route
from pagoda.api.health import health_routes
from pagoda.api.http_errors import ERRORS_OPT
from pagoda.api.limits import Limits, limits_middleware
from pagoda.api.metrics import Metrics
from pagoda.api.settings import ServeSettings
from pagoda.api.tenants import TenantTable
from pagoda.core.adapters import AdapterError, check_adapter_name
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins.manager import collect_disconnect_policies, collect_endpoints, collect_model_card, collect_routes
from pagoda.plugins.manager import collect_tool_parsers
from pagoda.plugins.protocol import ServeContext
from pagoda.plugins.route import Route, RouteContext, ServedModel

SCHEMA_PATH = "/schema"


def create_app(async_engine: AsyncEngine, tokenizer: Any, plugin_manager: pluggy.PluginManager,
               settings: ServeSettings) -> Litestar:
    """A Litestar app serving `async_engine` with the protocols and routes the plugins register."""
    policies = collect_disconnect_policies(plugin_manager)
    if settings.disconnect_policy not in policies:
        raise ValueError(f"disconnect_policy {settings.disconnect_policy!r} is not registered"
                         f" (registered: {', '.join(sorted(policies)) or 'none'})")
    parsers = collect_tool_parsers(plugin_manager)
    if settings.tool_parser is not None and settings.tool_parser not in parsers:
        raise ValueError(f"tool_parser {settings.tool_parser!r} is not registered"
                         f" (registered: {', '.join(sorted(parsers)) or 'none'}; 'none' serves no tools)")
    config = async_engine.engine.config
    context = ServeContext(tokenizer=tokenizer, model_name=settings.served_model_name,
                           max_model_len=config.max_model_len, max_kv_tokens=config.num_slots,
                           limits=settings.request_limits,
                           tool_parser=parsers[settings.tool_parser] if settings.tool_parser else None)
    metrics = Metrics()
    tenants = TenantTable(settings.api_key, settings.api_keys_file)  # a bad keys file: KeysFileError, a ValueError
    services = Services(engine=async_engine, context=context, metrics=metrics,
                        policy=policies[settings.disconnect_policy], send_stall_timeout=settings.send_stall_timeout,
                        tenants=tenants, model_names=(settings.served_model_name, *settings.served_model_aliases),
                        any_model_name=not settings.refuse_unknown_models,
                        generation_defaults=dict(settings.generation_defaults))
    served = ServedModel(name=settings.served_model_name, created=int(time.time()), max_model_len=config.max_model_len,
                         aliases=settings.served_model_aliases,
                         architecture=async_engine.engine.describe().get("architecture"),
                         batch_invariant=async_engine.engine.describe().get("batch_invariant"))
    for name in async_engine.adapters:  # loaded at start-up (--lora-modules): each needs a name of its own
        try:
            check_adapter_name(name, services.model_names)
        except AdapterError as exc:
            raise ValueError(f"--lora-modules: {exc}") from None

    def card_of(name: str) -> dict[str, Any]:  # the card of an adapter served as `name`: every plugin's fields
        return collect_model_card(plugin_manager, dataclasses.replace(served, name=name, aliases=(),
                                                                      created=int(time.time())))

    route_context = RouteContext(model=served, card=collect_model_card(plugin_manager, served),
                                 resolve_model=model_resolver(services), serving=context,
                                 adapters=adapter_cards(services, card_of, dict(settings.lora_parents)))
    guards = [tenants.guard] if tenants.needs_key else []
    routes = [endpoint_route(endpoint, services, guards) for endpoint in collect_endpoints(plugin_manager)]
    routes += [plugin_route(r, route_context, guards) for r in collect_routes(plugin_manager)]
    routes += health_routes(services, settings.health_timeout)
    if settings.enable_lora_loading:  # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
        routes += adapter_routes(services, guards)

    def start_engine() -> None:
        if not async_engine.is_running:
            async_engine.start()

    async def stop_engine() -> None:
        await asyncio.to_thread(async_engine.stop)

    app = Litestar(
        route_handlers=routes,
        on_startup=[start_engine],
        on_shutdown=[stop_engine],
        exception_handlers={HTTPException: handle_exception, Exception: handle_exception},
        middleware=[access_log_middleware,
                    limits_middleware(Limits(settings.max_body_bytes, settings.max_header_bytes), metrics)],
        request_max_body_size=settings.max_body_bytes,  # a chunked body has no length to refuse it by up front
        openapi_config=openapi_config(),
        cors_config=cors_config(settings.allowed_origins),
        logging_config=None,
    )
    app.state.services = services
    app.state.settings = settings
    return app


def cors_config(origins: tuple[str, ...]) -> CORSConfig | None:
    """Cross-origin access only for the origins named (--allowed-origins); none by default, so a web page on
    another origin cannot read a response (and a JSON POST needs a preflight that is refused)."""
    if not origins:
        return None
    return CORSConfig(allow_origins=list(origins))  # any method and header, as the SDKs send their own


def plugin_route(plugin: Route, context: RouteContext, guards: list[Guard]) -> HTTPRouteHandler:
    """The Litestar handler of a plugin's Route: made from `context`, guarded and shaped as it declares."""
    decorate = route(plugin.path, http_method=[plugin.method], media_type=plugin.media_type, cache=False, status_code=200,
                     guards=guards if plugin.guarded else [], opt={ERRORS_OPT: plugin.errors})
    return decorate(plugin.make(context))


def openapi_config() -> OpenAPIConfig:
    """The schema from the handlers' own types (each endpoint's body Struct): JSON at /schema, a UI beside it."""
    return OpenAPIConfig(
        title="pagoda", version=__version__, path=SCHEMA_PATH, use_handler_docstrings=True,
        render_plugins=[JsonRenderPlugin(path=["/", "/openapi.json"]), SwaggerRenderPlugin(path="/swagger")],
    )
