"""Routers in front of live replicas, all in this process on ports the kernel picks.

The replicas are real pagoda servers on the tiny random-weight model (as tests/server_fixtures.py
starts them, with the disconnect matrix's plugins), so a test can read each one's engine; the router
is the app `pagoda router` serves, under the same BackgroundServer. Which replica served an answer is
read off its `x-pagoda-replica` header. The session fixtures (`tiny_model_dir`) come from the conftest's
plugins, not imported into each module: an imported session fixture is set up again for every module
that imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.api.server import BackgroundServer
from pagoda.harness.live_server import LiveServer
from pagoda.model.hub import resolve_model
from pagoda.plugins.manager import load_plugins
from pagoda.router.app import create_router_app
from pagoda.router.replicas import Fleet
from pagoda.router.settings import RouterSettings
from tests.disconnect.helpers import PLUGINS_ENV, start_live
from tests.helpers import wait_for
from tests.server_fixtures import TINY_ENGINE, TINY_NAME

REPLICA_HEADER = "x-pagoda-replica"


@dataclass
class LiveRouter:
    """A running router and its fleet (the replicas as it sees them)."""

    url: str
    fleet: Fleet
    server: BackgroundServer

    def openai(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                             timeout=120, **kw)

    def anthropic(self, **kw: Any):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=kw.pop("api_key", "unused"), max_retries=0,
                                   timeout=120, **kw)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=60)

    def in_flight(self) -> list[int]:
        return [r.in_flight for r in self.fleet.replicas]

    def wait_healthy(self, *indices: int) -> None:
        """Until the router routes to exactly the replicas `indices` (a poll's answer, not a sleep)."""
        wait_for(lambda: [r.index for r in self.fleet.replicas if r.healthy] == list(indices),
                 f"the router to see replicas {indices} healthy", timeout=30)


@contextmanager
def live_router(replica_urls: Sequence[str], **settings: Any) -> Iterator[LiveRouter]:
    """A router over these replicas with these RouterSettings fields; stopped on the way out.

    A /health that is merely slow (a loaded test machine) must not take a replica out of a test's rotation:
    the health timeout is 30 s unless a test says otherwise (a replica that is down is refused at once). The
    prefix policy reads prompts with the default model's tokenizer, which the tiny model shares."""
    settings = {"health_timeout": 30.0, "model_dir": str(resolve_model("default", progress=False)), **settings}
    app = create_router_app(RouterSettings(tuple(replica_urls), **settings), plugins=load_plugins(PLUGINS_ENV))
    server = BackgroundServer(app).start()
    try:
        yield LiveRouter(server.url, app.state.fleet, server)
    finally:
        server.stop()


def start_replica(model_dir: Path, settings: dict[str, Any] | None = None, **engine: Any) -> LiveServer:
    """One tiny-model replica (the matrix's plugins, any model name answered), with these ServeSettings fields."""
    return start_live(model_dir, TINY_NAME, settings=settings, **{**TINY_ENGINE, **engine})


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path):
    """Two tiny-model replicas for a whole test module."""
    lives = [start_replica(tiny_model_dir) for _ in range(2)]
    try:
        yield lives
    finally:
        for live in lives:
            live.server.stop()


def served_by(response: httpx.Response, replicas: Sequence[LiveServer]) -> int:
    """The index of the replica that served `response`."""
    return [r.url for r in replicas].index(response.headers[REPLICA_HEADER])
