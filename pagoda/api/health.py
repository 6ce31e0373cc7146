"""The routes that are not a protocol: GET /health, GET /metrics, GET /v1/models."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

from litestar import Request, Response, get
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.types import Guard
from prometheus_client import CONTENT_TYPE_LATEST

from pagoda.api.errors import error_response
from pagoda.api.generation import Services
from pagoda.core.async_engine import EngineDeadError
from pagoda.plugins.protocol import ApiError


async def engine_stats(services: Services, timeout: float) -> dict[str, int] | None:
    """The engine loop's own answer, or None when it cannot give one in time."""
    try:
        return await asyncio.wait_for(services.engine.stats(), timeout)
    except (EngineDeadError, asyncio.TimeoutError):
        return None


def health_routes(services: Services, health_timeout: float, model_guards: list[Guard]) -> list[HTTPRouteHandler]:
    """/health and /metrics (always open) and the model list (behind the API key when one is set)."""
    started = int(time.time())
    model_name = services.context.model_name

    @get("/health", cache=False)
    async def health() -> Response[dict[str, Any]]:
        stats = await engine_stats(services, health_timeout)
        if stats is None:
            return Response({"status": "unavailable", "error": "the engine loop is not answering"}, status_code=503)
        return Response({"status": "ok", **stats}, status_code=200)

    @get("/metrics", cache=False)
    async def metrics() -> Response[bytes]:
        stats = await engine_stats(services, health_timeout)
        return Response(services.metrics.render(stats or {}), media_type=CONTENT_TYPE_LATEST, status_code=200)

    def model_card() -> dict[str, Any]:
        created_at = datetime.fromtimestamp(started, timezone.utc).isoformat().replace("+00:00", "Z")
        # One object read by both SDKs: OpenAI's fields and Anthropic's side by side.
        return {"id": model_name, "object": "model", "created": started, "owned_by": "pagoda",
                "type": "model", "display_name": model_name, "created_at": created_at,
                "max_model_len": services.context.max_model_len}

    @get("/v1/models", guards=model_guards, cache=False)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()], "has_more": False,
                "first_id": model_name, "last_id": model_name}

    @get("/v1/models/{model_id:str}", guards=model_guards, cache=False)
    async def get_model(request: Request, model_id: FromPath[str]) -> Response[dict[str, Any]]:
        if model_id != model_name:
            message = f"model {model_id!r} does not exist; this server serves {model_name!r}"
            return error_response(None, ApiError(404, message, "model", "model_not_found"), request)
        return Response(model_card(), status_code=200)

    return [health, metrics, list_models, get_model]
