"""A live pagoda server in this process: real uvicorn on 127.0.0.1, a port the kernel picks.

The server runs on a background thread with its own event loop, so the caller
keeps the engine it audits while sockets, HTTP parsing and disconnects are
real. Used by the test suite, the acceptance crowd and the serving benchmarks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagoda.api.app import create_app
from pagoda.model.architectures import Architectures
from pagoda.model.families import register_families
from pagoda.model.factory import EngineOptions, build_engine
from pagoda.api.server import BackgroundServer
from pagoda.api.settings import ServeSettings
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins.manager import registered_endpoints
from pagoda.plugins.manager import collect_architectures, collect_scheduling_policies, load_plugins
from pagoda.plugins.protocol import Endpoint


@dataclass
class LiveServer:
    """A running server and the engine behind it."""

    url: str
    async_engine: AsyncEngine
    server: BackgroundServer
    model_name: str
    api_key: str | None = None
    endpoints: dict[str, Endpoint] = dataclasses.field(default_factory=dict)  # what it serves, by protocol name

    def openai(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", self.api_key or "unused"),
                             max_retries=0, timeout=120, **kw)

    def anthropic(self, **kw: Any):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=kw.pop("api_key", self.api_key or "unused"),
                                   max_retries=0, timeout=120, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=60).json()

    def assert_pool_whole(self) -> dict[str, Any]:
        """Ask the engine loop (not the allocator from this thread) that it is idle, audited and whole."""
        async def check() -> dict[str, int]:
            await self.async_engine.wait_until_idle()
            await self.async_engine.audit()
            return await self.async_engine.stats()

        stats = asyncio.run(asyncio.wait_for(check(), 60))
        assert stats["running"] == 0 and stats["waiting"] == 0, stats
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
        health = self.health()
        assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks_total"], health
        return stats


def start_server(model_dir: Path | str, model_name: str, *, api_key: str | None = None,
                 environ: dict[str, str] | None = None, settings: ServeSettings | None = None,
                 refuse_unknown_models: bool = False, **engine_options: Any) -> LiveServer:
    """Build the engine through the real loading path and serve it; stop it with `.server.stop()`.

    `engine_options` are EngineOptions fields (device, dtype and quantization default to cpu/float32/none here:
    the exact path, whose answers equal transformers'; `pagoda serve`'s default is quantization auto);
    `settings` replaces the serve settings (its model name and key are taken from the arguments).
    The crowd clients and most tests send a placeholder model name, so by default any name is answered
    as `model_name`; `refuse_unknown_models=True` serves as `pagoda serve` does (404 for another name).
    """
    settings = dataclasses.replace(settings or ServeSettings(), served_model_name=model_name, api_key=api_key,
                                   refuse_unknown_models=refuse_unknown_models)
    plugins = register_families(load_plugins(environ or {}, disabled=settings.disabled_plugins))
    # the model is looked up in the architectures these plugins register, as `pagoda serve` does
    engine_options.setdefault("architectures", Architectures(collect_architectures(plugins)))
    engine_options.setdefault("scheduling_policies", collect_scheduling_policies(plugins))  # and the policies
    options = EngineOptions(**{"model": str(model_dir), "device": "cpu", "dtype": "float32", "quantization": "none",
                               **engine_options})
    engine, tokenizer, _ = build_engine(options, progress=False)
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, tokenizer, plugins, settings)
    server = BackgroundServer(app, send_buffer=settings.send_buffer_size).start()
    return LiveServer(url=server.url, async_engine=async_engine, server=server, model_name=model_name, api_key=api_key,
                      endpoints=registered_endpoints(plugins))


@contextmanager
def live_server(model_dir: Path | str, model_name: str, **options: Any):
    """`start_server` as a context manager: the server is stopped on the way out."""
    live = start_server(model_dir, model_name, **options)
    try:
        yield live
    finally:
        live.server.stop()
