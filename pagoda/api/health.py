"""The server's own routes: GET /health and GET /metrics (always open, even with --api-key set).

GET /v1/models and the chat page are plugin routes (pagoda/plugins/builtin/models.py, chat_page.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Response, get
from litestar.handlers import HTTPRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST

from pagoda.api.generation import Services
from pagoda.core.async_engine import EngineDeadError


async def engine_stats(services: Services, timeout: float) -> dict[str, int] | None:
    """The engine loop's own answer, or None when it cannot give one in time."""
    try:
        return await asyncio.wait_for(services.engine.stats(), timeout)
    except (EngineDeadError, asyncio.TimeoutError):
        return None


def health_routes(services: Services, health_timeout: float) -> list[HTTPRouteHandler]:
    """/health (503 when the engine loop does not answer) and /metrics."""

    @get("/health", cache=False)
    async def health() -> Response[dict[str, Any]]:
        """The engine loop's counters and queues; 503 when it cannot serve."""
        stats = await engine_stats(services, health_timeout)
        if stats is None:
            return Response({"status": "unavailable", "error": "the engine loop is not answering"}, status_code=503)
        return Response({"status": "ok", **stats}, status_code=200)

    @get("/metrics", cache=False)
    async def metrics() -> Response[bytes]:
        """Prometheus metrics, names starting with pagoda_."""
        stats = await engine_stats(services, health_timeout)
        return Response(services.metrics.render(stats or {}), media_type=CONTENT_TYPE_LATEST, status_code=200)

    return [health, metrics]
