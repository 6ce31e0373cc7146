"""The Litestar application: protocol endpoints from the plugins, health, metrics, auth, access log.

`create_app` bridges the plugin registry to Litestar: every Endpoint that a
plugin registers becomes a POST route running the shared handler in
pagoda.api.generation. The app owns the engine loop's lifetime: it starts
the loop at start-up and stops it at shutdown.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pluggy
from litestar import Litestar
from litestar.exceptions import HTTPException

from pagoda.api.access_log import access_log_middleware
from pagoda.api.auth import api_key_guard
from pagoda.api.errors import handle_exception
from pagoda.api.generation import Services, endpoint_route
from pagoda.api.health import health_routes
from pagoda.api.metrics import Metrics
from pagoda.api.settings import ServeSettings
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins.manager import collect_disconnect_policies, collect_endpoints
from pagoda.plugins.protocol import ServeContext


def create_app(async_engine: AsyncEngine, tokenizer: Any, plugin_manager: pluggy.PluginManager,
               settings: ServeSettings) -> Litestar:
    """A Litestar app serving `async_engine` with the protocols the plugins register."""
    policies = collect_disconnect_policies(plugin_manager)
    if settings.disconnect_policy not in policies:
        raise ValueError(f"disconnect_policy {settings.disconnect_policy!r} is not registered"
                         f" (registered: {', '.join(sorted(policies)) or 'none'})")
    config = async_engine.engine.config
    context = ServeContext(tokenizer=tokenizer, model_name=settings.served_model_name,
                           max_model_len=config.max_model_len, max_kv_tokens=config.num_slots)
    services = Services(engine=async_engine, context=context, metrics=Metrics(),
                        policy=policies[settings.disconnect_policy], send_stall_timeout=settings.send_stall_timeout)
    guards = [api_key_guard(settings.api_key)] if settings.api_key else []
    routes = [endpoint_route(endpoint, services, guards) for endpoint in collect_endpoints(plugin_manager)]
    routes += health_routes(services, settings.health_timeout, guards)

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
        middleware=[access_log_middleware],
        openapi_config=None,
        logging_config=None,
    )
    app.state.services = services
    app.state.settings = settings
    return app
