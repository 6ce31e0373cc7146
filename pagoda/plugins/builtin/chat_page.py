"""GET /: a chat page in the browser, streaming from /v1/chat/completions.

The page is one static file beside this module (chat_page.html, package data):
no build step, and nothing is loaded from elsewhere, so it works offline; its
Content-Security-Policy says so to the browser too. The route is open even
with --api-key set: the page holds nothing secret, and asks for the key,
which it sends as `Authorization: Bearer` on its own requests.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from litestar import Response
from litestar.enums import MediaType

from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.route import Route, RouteContext

PAGE = "chat_page.html"
# Only this server: the page's inline script and style, and fetches to its own routes.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"


def make_page(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of GET /: the page, read once when the app is built."""
    html = resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")

    async def chat_page() -> Response[str]:
        """A chat page streaming from /v1/chat/completions."""
        return Response(html, headers={"content-security-policy": CSP})

    return chat_page


@hookimpl
def pagoda_register_routes(register):
    register(Route("GET", "/", make_page, guarded=False, media_type=MediaType.HTML))
