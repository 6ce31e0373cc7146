"""The server's own routes: GET /health and GET /metrics (always open, even with --api-key set).

Both read the stats the engine loop published after its latest turn
(`AsyncEngine.latest_stats`): the loop's own numbers, answered at once instead
of after the step in progress (a step under load takes hundreds of ms).
LoRA adapters are resident memory beside the weights and the KV pool: /health
lists each one loaded (`lora_adapters`: name, rank, bytes, target modules, and
`unloading`: true while an unload waits for its requests in flight, when new
requests may no longer name it) beside the stats' `lora_adapters_loaded`,
`lora_adapter_bytes` and `lora_adapters_in_use`, which /metrics has as gauges.
/health is open, so it never says where an adapter lives on the server's disk.

GET /v1/models and the chat page are plugin routes (pagoda/plugins/builtin/models.py, chat_page.py).
"""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.handlers import HTTPRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST

from pagoda.api.generation import Services
from pagoda.core.async_engine import EngineDeadError


def engine_stats(services: Services, timeout: float) -> dict[str, int] | None:
    """The engine loop's latest published stats, or None when it cannot serve (dead, or a step stuck > timeout)."""
    try:
        return services.engine.latest_stats(stuck_after=timeout)
    except EngineDeadError:
        return None


def lora_adapters(services: Services) -> list[dict[str, Any]]:
    """/health's `lora_adapters`: every adapter holding memory, without its path (the table the engine's thread
    publishes whole, so it is read here without waiting for a step)."""
    return [{**{k: v for k, v in info.describe().items() if k != "path"}, "unloading": unloading}
            for info, unloading in services.engine.engine.adapters.resident.values()]


def health_routes(services: Services, health_timeout: float) -> list[HTTPRouteHandler]:
    """/health (503 when the engine loop does not answer) and /metrics."""
    speculation = services.engine.engine.speculation.describe()
    described = services.engine.engine.describe()  # set at start-up: how the engine runs (a tensor-parallel group)

    @get("/health", cache=False)
    async def health() -> Response[dict[str, Any]]:
        """The engine loop's counters and queues; 503, saying why, when it cannot serve."""
        try:
            stats = services.engine.latest_stats(stuck_after=health_timeout)
        except EngineDeadError as exc:
            return Response({"status": "unavailable", "error": str(exc), **described}, status_code=503)
        # set at start-up: the setting and the runner's row multiple
        stats = {**stats, "speculation": speculation, **described, "lora_adapters": lora_adapters(services)}
        if services.drain.draining:
            return Response({"status": "draining", **stats}, status_code=503)
        return Response({"status": "ok", **stats}, status_code=200)

    @get("/metrics", cache=False)
    async def metrics() -> Response[bytes]:
        """Prometheus metrics, names starting with pagoda_."""
        stats = engine_stats(services, health_timeout)
        return Response(services.metrics.render(stats or {}), media_type=CONTENT_TYPE_LATEST, status_code=200)

    return [health, metrics]
