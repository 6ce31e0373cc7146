"""The router's Litestar app: its own /health and /metrics, and every other path proxied to a replica.

The app owns the replicas' connection pools and the health poller: its start-up opens one
`httpx.AsyncClient` per replica (a pool of `max_queue_per_replica` connections, no read timeout:
a stream may last minutes), polls every replica once, so that the first request already knows which
are healthy, and starts polling; its shutdown stops the poller and closes the pools.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pluggy
from litestar import Litestar, Response, asgi, get
from litestar.types import Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST

from pagoda.api.tenants import TenantTable
from pagoda.core.tokenizer import Tokenizer
from pagoda.plugins.manager import collect_tool_parsers, load_plugins
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policy import BuiltinPolicy
from pagoda.router.prompts import PromptReader
from pagoda.router.proxy import Proxy
from pagoda.router.replicas import Fleet
from pagoda.router.routes import RouteTable
from pagoda.router.settings import RouterSettings

# An idle pooled connection is dropped after this many seconds, well before the replica's uvicorn closes it
# (its keep-alive timeout, 5 s): a request sent on a connection the replica is closing at that moment gets no
# answer, and since the router cannot tell whether the replica read it, it answers 502 instead of retrying.
KEEPALIVE_EXPIRY = 2.0


def create_router_app(settings: RouterSettings, plugins: pluggy.PluginManager | None = None) -> Litestar:
    """A router over `settings.replicas`; `plugins` (default: those `pagoda serve` loads) say what each path is."""
    plugins = plugins if plugins is not None else load_plugins()
    table = RouteTable.from_plugins(plugins)
    policy = BuiltinPolicy(settings.policy, settings.seed, settings.balance_abs_threshold,
                           settings.balance_rel_threshold, settings.cache_threshold)
    fleet = Fleet(settings.replicas, policy, settings.max_queue_per_replica)
    metrics = RouterMetrics(fleet)
    tenants = TenantTable(settings.api_key, settings.api_keys_file)  # a bad keys file: KeysFileError, a ValueError
    proxy = Proxy(fleet, table, metrics, settings, tenants,
                  prompt_reader(settings, plugins, tenants, fleet) if policy.reads_prompt else None)

    @get("/health", cache=False)
    async def health() -> Response[dict[str, Any]]:
        """The replicas' counters summed over the healthy ones, and each replica's; 503 when none is healthy, or
        while the router drains ("status": "draining")."""
        summary = fleet.summary()
        return Response(summary, status_code=200 if summary["status"] == "ok" else 503)

    @get("/metrics", cache=False)
    async def router_metrics() -> Response[bytes]:
        """Prometheus metrics, names starting with pagoda_router_."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST, status_code=200)

    @asgi("/", is_mount=True, copy_scope=True)
    async def forward(scope: Scope, receive: Receive, send: Send) -> None:
        await proxy(scope, receive, send)

    @contextlib.asynccontextmanager
    async def replicas_open(_: Litestar) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=settings.connect_timeout, read=None, write=None, pool=None)
        limits = httpx.Limits(max_connections=settings.max_queue_per_replica,
                              max_keepalive_connections=settings.max_queue_per_replica,
                              keepalive_expiry=KEEPALIVE_EXPIRY)
        for replica in fleet.replicas:
            replica.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        health_client = httpx.AsyncClient(timeout=settings.health_timeout)
        poller: asyncio.Task[None] | None = None
        try:
            await fleet.poll_once(health_client, settings.health_timeout)
            poller = asyncio.create_task(fleet.poll_forever(health_client, settings.health_interval,
                                                            settings.health_timeout))
            yield
        finally:
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
            for client in [health_client, *(r.client for r in fleet.replicas if r.client is not None)]:
                await client.aclose()

    # logging is the command's (pagoda router sets it up), as the server's: Litestar's default adds a root handler
    app = Litestar([health, router_metrics, forward], lifespan=[replicas_open], openapi_config=None,
                   logging_config=None)
    app.state.fleet = fleet  # read by tests and by whoever embeds a router

    async def drain() -> None:
        """On the first SIGTERM (`pagoda router`): 503 to new requests and on /health, those in flight run on."""
        await fleet.drain(settings.shutdown_timeout)

    app.state.drain = drain
    app.state.tenants = tenants  # `pagoda router` re-reads its keys file on SIGHUP
    return app


def prompt_reader(settings: RouterSettings, plugins: pluggy.PluginManager, tenants: TenantTable,
                  fleet: Fleet | None = None) -> PromptReader:
    """Reads prompts with the replicas' tokenizer and tool parser (the model directory's, no weights), keying each
    under the LoRA adapter its `model` names when `fleet`'s replicas serve one."""
    if settings.model_dir is None:
        raise ValueError("the prefix policy reads prompts with the replicas' tokenizer: give the model (--model)")
    parsers = collect_tool_parsers(plugins)
    if settings.tool_parser is not None and settings.tool_parser not in parsers:
        raise ValueError(f"tool_parser {settings.tool_parser!r} is not registered; registered: {', '.join(parsers)}")
    return PromptReader(Tokenizer.from_dir(settings.model_dir), tenants,
                        parsers[settings.tool_parser] if settings.tool_parser else None,
                        fleet.adapter_names if fleet is not None else frozenset)
