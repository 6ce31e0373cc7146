"""The one handler every protocol endpoint runs through.

    body (decoded by Litestar into the endpoint's Struct; the API key checked by a guard)
      -> endpoint.prepare -> engine.generate -> metrics.observe
      -> unary:  the whole generation raced against the client leaving -> endpoint.render
      -> stream: admission and the first output raced the same way, then a Stream of
                 endpoint.render_stream's events, encoded as SSE or NDJSON

The engine request is aborted by `AsyncEngine.generate` itself whenever its
iterator ends before the request finished; every path here only has to stop
iterating (cancellation, close, exception), and every iterator is closed
explicitly rather than left to the garbage collector.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody
from litestar.response import Stream
from litestar.types import Guard

from pagoda.api.access_log import access_record
from pagoda.api.disconnect import CLIENT_GONE, run_until_client_leaves
from pagoda.api.errors import ENDPOINT_OPT, api_error, error_response
from pagoda.api.metrics import AccessRecord, Metrics
from pagoda.core.async_engine import AsyncEngine
from pagoda.core.engine import RequestOutput
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.protocol import Call, Completion, Endpoint, Event, ServeContext

logger = logging.getLogger("pagoda.api")

MEDIA_TYPES = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; only the access log ever sees it


@dataclass(frozen=True)
class Services:
    """What the endpoint handlers share."""

    engine: AsyncEngine
    context: ServeContext
    metrics: Metrics
    policy: DisconnectPolicy


def endpoint_route(endpoint: Endpoint, services: Services, guards: list[Guard]) -> HTTPRouteHandler:
    """A Litestar POST handler for one protocol endpoint."""

    async def handler(request: Request, data: Any) -> Response[Any]:
        return await serve(endpoint, services, request, data)

    # Litestar reads the body type from the annotations: each endpoint's own Struct.
    handler.__annotations__ = {"request": Request, "data": JSONBody[endpoint.body_type], "return": Response[Any]}
    handler.__name__ = handler.__qualname__ = f"serve_{endpoint.name.replace('-', '_')}"
    route = post(endpoint.path, name=endpoint.name, status_code=200, guards=guards, opt={ENDPOINT_OPT: endpoint})
    return route(handler)


async def serve(endpoint: Endpoint, services: Services, request: Request, body: Any) -> Response[Any]:
    """Answer one protocol request; every failure becomes the protocol's error body."""
    record = access_record(request.scope)
    try:
        generation = endpoint.prepare(body, services.context)
        call = Call(id=endpoint.new_id(), created=int(time.time()), model=services.context.model_name, body=body,
                    generation=generation, tokenizer=services.context.tokenizer)
        outputs = services.metrics.observe(
            services.engine.generate(generation.prompt_token_ids, generation.sampling_params, call.id), record
        )
        if generation.stream:
            return await _stream(endpoint, call, outputs, request, services.policy, record)
        return await _unary(endpoint, call, outputs, request, services.policy)
    except Exception as exc:
        return error_response(endpoint, api_error(exc), request)


async def _unary(endpoint: Endpoint, call: Call, outputs: AsyncIterator[RequestOutput], request: Request,
                 policy: DisconnectPolicy) -> Response[Any]:
    result = await run_until_client_leaves(_collect(outputs), request.receive, policy)
    if result is CLIENT_GONE:
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    return Response(endpoint.render(call, result), status_code=200)


async def _collect(outputs: AsyncIterator[RequestOutput]) -> Completion:
    async with contextlib.aclosing(outputs):
        return Completion.from_outputs([out async for out in outputs])


async def _stream(endpoint: Endpoint, call: Call, outputs: AsyncIterator[RequestOutput], request: Request,
                  policy: DisconnectPolicy, record: AccessRecord) -> Response[Any]:
    # Nothing is written before the first output, so admission errors are still answered with a
    # status, and a client that leaves during a long prefill is caught by the watcher.
    first = await run_until_client_leaves(_first(outputs), request.receive, policy)
    if first is CLIENT_GONE:
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    body = _stream_body(endpoint, call, _prepend(first, outputs), record)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Stream(body, media_type=MEDIA_TYPES[endpoint.stream_format], headers=headers)


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await outputs.__anext__()
    except BaseException:
        await outputs.aclose()
        raise


async def _prepend(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    async with contextlib.aclosing(outputs):
        yield first
        async for out in outputs:
            yield out


async def _stream_body(endpoint: Endpoint, call: Call, outputs: AsyncIterator[RequestOutput],
                       record: AccessRecord) -> AsyncIterator[bytes]:
    """The encoded events; a failure after the 200 went out becomes the protocol's in-stream error."""
    encode = encode_sse if endpoint.stream_format == "sse" else encode_ndjson
    events = endpoint.render_stream(call, outputs)
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield encode(event)
    except Exception as exc:
        record.abort_reason = record.abort_reason or "error"
        await outputs.aclose()  # before the error goes out, so the abort is already queued
        for event in endpoint.render_stream_error(call, api_error(exc)):
            yield encode(event)
    finally:
        await outputs.aclose()  # a renderer that stopped early does not leave the request running


def encode_sse(event: Event) -> bytes:
    """One server-sent event: an optional `event:` line, one `data:` line, a blank line."""
    data = event.data if isinstance(event.data, str) else msgspec.json.encode(event.data).decode()
    head = f"event: {event.name}\n" if event.name else ""
    return f"{head}data: {data}\n\n".encode()


def encode_ndjson(event: Event) -> bytes:
    """One line of newline-delimited JSON."""
    data = event.data.encode() if isinstance(event.data, str) else msgspec.json.encode(event.data)
    return data + b"\n"
