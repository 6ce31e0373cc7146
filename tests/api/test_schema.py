"""The OpenAPI schema at /schema: every route the app serves, from the types its handlers decode."""

import httpx
import pytest

from pagoda.api.app import SCHEMA_PATH, create_app
from pagoda.api.server import BackgroundServer
from pagoda.api.settings import ServeSettings
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins.manager import load_plugins
from tests.helpers import fake_engine

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


@pytest.fixture(scope="module")
def server():
    """A live server with every installed plugin (the schema does not depend on the model)."""
    with BackgroundServer(create_app(AsyncEngine(fake_engine()), None, load_plugins({}), ServeSettings())) as live:
        yield live


def served_routes(app) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, the schema's own routes and implicit OPTIONS left out."""
    return {(method, route.path_format) for route in app.routes if not route.path.startswith(SCHEMA_PATH)
            for method in route.methods - {"OPTIONS", "HEAD"}}


def test_the_schema_lists_every_route_the_app_serves(server):
    r = httpx.get(f"{server.url}{SCHEMA_PATH}/openapi.json", timeout=60)
    assert r.status_code == 200
    schema = r.json()
    listed = {(method.upper(), path) for path, item in schema["paths"].items() for method in item
              if method in HTTP_METHODS}
    assert listed == served_routes(server.app)
    # The endpoints, the plugins' routes (the models, the chat page, an installed plugin's) and the server's own.
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("GET", "/v1/models"),
            ("GET", "/v1/models/{model_id}"), ("GET", "/"), ("GET", "/health"), ("GET", "/metrics")} <= listed
    assert ("POST", "/api/chat") in listed  # the Ollama example plugin, installed by `make test`
    assert httpx.get(f"{server.url}{SCHEMA_PATH}", timeout=60).json() == schema  # /schema itself is the JSON


def _body_schema(schema: dict, path: str) -> dict:
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]


def test_the_request_schemas_are_the_structs_the_plugins_decode(server):
    schema = httpx.get(f"{server.url}{SCHEMA_PATH}/openapi.json", timeout=60).json()
    chat = _body_schema(schema, "/v1/chat/completions")
    assert {"messages", "model"} <= set(chat["required"])
    assert {"messages", "temperature", "max_tokens", "stream", "top_k"} <= set(chat["properties"])
    messages = _body_schema(schema, "/v1/messages")
    assert {"model", "messages", "max_tokens"} <= set(messages["required"])
    page = schema["paths"]["/"]["get"]["responses"]["200"]["content"]
    assert set(page) == {"text/html"}


def test_the_swagger_ui_carries_the_schema_in_its_page(server):
    # Its scripts come from a CDN (docs/plugins.md says so); the schema itself is in the page.
    r = httpx.get(f"{server.url}{SCHEMA_PATH}/swagger", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '"/v1/chat/completions":{"post"' in r.text
