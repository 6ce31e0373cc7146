"""The one handler every protocol endpoint runs through, and the life of its engine request.

    handler    body (decoded by Litestar into the endpoint's Struct; the API key matched to a tenant by a guard)
               -> its model (the served one, or a LoRA adapter the tenant may use: served_model; else 404)
               -> endpoint.prepare -> the tenant's limits (a Ticket, or 429: pagoda.api.tenant_limits)
               -> an Exchange in a GenerationResponse; nothing has reached the engine yet
    responder  (the response's ASGI call) the job, a task consuming engine.generate's answer deltas
               through metrics.observe (one engine request per choice), raced against the client leaving:
      unary    the whole answer -> endpoint.render -> one JSON write
      stream   admission -> 200, a keep-alive comment -> endpoint.render_stream's events as they come

The request's whole life is one ASGI call, `Responder.__call__`, so its end is
one `finally`: the job is cancelled there unless it finished, and cancelling
the job aborts the engine request. Every exit goes through it: a return, an
exception, the handler's own cancellation, a failed or stalled write. A
client found gone anywhere (`ClientGone`: a disconnect seen by the watch, a
write that raised or stalled) is handled in one `except`: the departure is
counted, the disconnect policy decides how long the job may go on, and a
response not yet started is answered 499 for the access log.

A stream's status line waits for admission (not for the first token), so a
request the engine refuses is still a 400 on every path, while a long prefill
already has its headers and a comment on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody
from litestar.types import ASGIApp, Guard, Receive, Scope, Send

from pagoda.api.access_log import CLIENT_CLOSED_REQUEST, access_record
from pagoda.api.body import STATE_KEY, strict_body
from pagoda.api.client_watch import SEND_STALL, ClientGone, ClientWatch, end_job
from pagoda.api.drain import DrainState
from pagoda.api.errors import api_error
from pagoda.api.http_errors import ERRORS_OPT, error_response
from pagoda.api.keys_file import Tenant
from pagoda.api.metrics import Metrics
from pagoda.api.stream_writer import END, ENCODERS, GONE, ResponseWriter
from pagoda.api.tenant_limits import Refusal, TenantLimits, Ticket
from pagoda.api.tenants import TenantTable
from pagoda.core.adapters import AdapterInfo
from pagoda.core.async_engine import AsyncEngine
from pagoda.core.outputs import AnswerDelta
from pagoda.core.sampling_params import SamplingParams
from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.choices import fan_out
from pagoda.plugins.protocol import Answer, ApiError, Endpoint, EngineRequest, Exchange, ServeContext
from pagoda.plugins.request_fields import RequestError

logger = logging.getLogger("pagoda.api")


@dataclass(frozen=True)
class Services:
    """What the endpoint handlers share."""

    engine: AsyncEngine
    context: ServeContext
    metrics: Metrics
    policy: DisconnectPolicy
    send_stall_timeout: float = 2.0  # --send-stall-timeout (the policy may change it)
    tenants: TenantTable = field(default_factory=TenantTable)  # who a request is, from its key (no key: one)
    tenant_limits: TenantLimits | None = None  # their limits; None = made from `metrics`
    drain: DrainState = field(default_factory=DrainState)  # set on SIGTERM: new requests are refused
    model_names: tuple[str, ...] = ()  # the served name and its aliases (() = the context's model_name alone)
    # a generation request naming another model is answered by the base, as the first name (the live harness's
    # refuse_unknown_models=False); False: 404 model_not_found, as `pagoda serve` answers
    any_model_name: bool = False
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # the model's, from generation_config.json

    def __post_init__(self) -> None:
        if self.tenant_limits is None:
            object.__setattr__(self, "tenant_limits", TenantLimits(self.metrics))


def endpoint_route(endpoint: Endpoint, services: Services, guards: list[Guard]) -> HTTPRouteHandler:
    """A Litestar POST handler for one protocol endpoint."""

    async def handler(request: Request, data: Any) -> Response[Any]:
        return serve(endpoint, services, request, getattr(request.state, STATE_KEY, data))  # the strict decoding's

    # Litestar reads the body type from the annotations (each endpoint's own Struct) for the schema; the body
    # itself is decoded strictly by the before_request hook (pagoda.api.body), which answers a bad one.
    handler.__annotations__ = {"request": Request, "data": JSONBody[endpoint.body_type], "return": Response[Any]}
    handler.__name__ = handler.__qualname__ = f"serve_{endpoint.name.replace('-', '_')}"
    route = post(endpoint.path, name=endpoint.name, status_code=200, guards=guards, opt={ERRORS_OPT: endpoint.errors},
                 before_request=strict_body(endpoint))
    return route(handler)


def serve(endpoint: Endpoint, services: Services, request: Request, body: Any) -> Response[Any]:
    """The response to one protocol request; a body the protocol refuses is answered at once."""
    unavailable = _unavailable(services)
    if unavailable is not None:
        services.metrics.rejected.labels(reason=unavailable[0]).inc()
        return error_response(endpoint.errors, ApiError(503, unavailable[1]))
    tenant = services.tenants.of(request)
    access_record(request.scope).tenant = tenant.name
    try:
        model, adapter = served_model(services, getattr(body, "model", None), tenant,
                                      any_name=services.any_model_name)
        prepared = endpoint.prepare(body, services.context)
        for engine_request in [prepared] if isinstance(prepared, EngineRequest) else prepared:
            engine_request.sampling_params = with_generation_defaults(body, engine_request.sampling_params,
                                                                  services.generation_defaults)
        choices = fan_out(prepared)  # one engine request per choice, in the response's index order
    except Exception as exc:
        return error_response(endpoint.errors, api_error(exc))
    ticket = services.tenant_limits.admit(tenant, sum(len(c.prompt_token_ids) for c in choices))
    if isinstance(ticket, Refusal):
        return tenant_refusal(endpoint, ticket)
    exchange = Exchange(id=endpoint.new_id(), created=int(time.time()), model=model, body=body,
                        request=choices[0], tokenizer=services.context.tokenizer, choices=choices)
    return GenerationResponse(Responder(endpoint, services, exchange, request, ticket, adapter))


def tenant_refusal(endpoint: Endpoint, refusal: Refusal) -> Response[Any]:
    """429 in the protocol's shape, with the Retry-After the tenant's limit gives."""
    response = error_response(endpoint.errors, ApiError(429, refusal.message, None, "rate_limit_exceeded"))
    response.headers["retry-after"] = str(refusal.retry_after)
    return response


def served_model(services: Services, asked: str | None, tenant: Tenant, *,
                 any_name: bool = False) -> tuple[str, str | None]:
    """(the name a response reports, the LoRA adapter the request runs with; None: the base model).

    The one place a request's `model` is resolved, for the protocols and every route that names a model
    (`RouteContext.resolve_model`): none, the served name or an alias is the base model; the name of a loaded
    adapter the tenant may use (`Tenant.adapters`) is that adapter, reported as its own name; any other name is
    refused with 404 model_not_found naming what this tenant may ask for, or, with `any_name`, answered by the
    base model under the served name."""
    names = services.model_names or (services.context.model_name,)
    if asked is None:
        return names[0], None
    if asked in names:
        return asked, None
    adapters = visible_adapters(services, tenant)
    if asked in adapters:
        return asked, asked
    if any_name:
        return names[0], None
    served = ", ".join(map(repr, names))
    if adapters:
        served += f", and the LoRA adapters {', '.join(map(repr, sorted(adapters)))}"
    raise RequestError(f"model {asked!r} does not exist; this server serves {served}", "model", status=404,
                       code="model_not_found")


def visible_adapters(services: Services, tenant: Tenant) -> dict[str, AdapterInfo]:
    """The loaded LoRA adapters `tenant` may name as its model, by name (an adapter being unloaded is not)."""
    return {name: info for name, info in services.engine.adapters.items() if tenant.may_use(name)}


def with_generation_defaults(body: Any, params: SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """`params` with the model's default for each sampling field the body has and left null (vLLM's behaviour)."""
    chosen = {k: v for k, v in defaults.items() if hasattr(body, k) and getattr(body, k) is None}
    return dataclasses.replace(params, **chosen) if chosen else params


def _unavailable(services: Services) -> tuple[str, str] | None:
    """(metric reason, message) when the server takes no new generation requests: draining, or no engine loop."""
    if services.drain.draining:
        return "draining", "the server is shutting down and takes no new requests"
    if not services.engine.is_running:
        return "engine_unavailable", "the engine loop is not running; this server cannot serve requests"
    return None


class GenerationResponse(Response[Any]):
    """A Litestar Response whose ASGI side is a Responder: Litestar only hands it the connection."""

    def __init__(self, responder: Responder) -> None:
        super().__init__(content=None)
        self.responder = responder

    def to_asgi_response(self, app: Any, request: Request, **_: Any) -> ASGIApp:
        return self.responder


class Responder:
    """One generation request, from admission to its last write: an ASGI app called once."""

    def __init__(self, endpoint: Endpoint, services: Services, exchange: Exchange, request: Request,
                 ticket: Ticket, adapter: str | None = None) -> None:
        self.endpoint = endpoint
        self.services = services
        self.exchange = exchange
        self.request = request
        self.ticket = ticket  # its place in its tenant's limits, released in the one `finally`
        self.adapter = adapter  # the LoRA adapter every choice runs with (None: the base model)
        self.record = access_record(request.scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._serve(receive, send)
        finally:
            self.ticket.release()

    async def _serve(self, receive: Receive, send: Send) -> None:
        policy = self.services.policy
        writer = ResponseWriter(send, policy.send_stall_timeout(self.services.send_stall_timeout))
        watch = ClientWatch(receive)  # Litestar has read the body: the watch may have `receive` now
        admitted = asyncio.Event()
        job, mailbox = self._start_job(watch, admitted)
        try:
            await self._respond(job, admitted, mailbox, watch, writer)
        except ClientGone as gone:
            await self._client_gone(job, gone.reason, writer)
        finally:
            watch.close()
            await end_job(job)  # the one place: whatever still runs here is cancelled, its request aborted

    def _start_job(self, watch: ClientWatch,
                   admitted: asyncio.Event) -> tuple[asyncio.Future[Any], asyncio.Queue[Any]]:
        """The task consuming the engine's outputs (and, for a stream, the mailbox it fills).

        One job for all of a request's choices (one engine request each): it is admitted once every choice
        is, and its cancellation, or one choice failing, ends them all."""
        choices = self.exchange.choices
        tenant = self.ticket.tenant
        waiting = [len(choices)]

        def on_admitted() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                admitted.set()

        outputs = [self.ticket.count(self.services.metrics.observe(
            self.services.engine.generate(g.prompt_token_ids, g.sampling_params,
                                          self.exchange.id if len(choices) == 1 else f"{self.exchange.id}-{k}",
                                          on_admitted=on_admitted, cache_salt=g.cache_salt, tenant=tenant.cache_key,
                                          priority=tenant.priority if g.priority is None else g.priority,
                                          weight=tenant.weight, adapter=self.adapter),
            self.record)) for k, g in enumerate(choices)]
        mailbox: asyncio.Queue[Any] = asyncio.Queue()  # what a stream's writer waits on (pagoda.api.stream_writer)
        if not self.exchange.request.stream:
            return asyncio.ensure_future(_collect_all(outputs)), mailbox
        job = asyncio.ensure_future(self._pump(outputs, admitted, mailbox))
        job.add_done_callback(lambda _: mailbox.put_nowait(END))
        watch.on_gone(lambda: mailbox.put_nowait(GONE))
        return job, mailbox

    async def _respond(self, job: asyncio.Future[Any], admitted: asyncio.Event, mailbox: asyncio.Queue[Any],
                       watch: ClientWatch, writer: ResponseWriter) -> None:
        """Write the response; a refusal (or a failure before anything was written) gets its error status."""
        try:
            if self.exchange.request.stream:
                await self._stream(job, admitted, mailbox, watch, writer)
            else:
                await self._unary(job, watch, writer)
        except ClientGone:
            raise
        except Exception as exc:
            if writer.started:
                raise
            await self._answer(error_response(self.endpoint.errors, api_error(exc)), writer)

    async def _unary(self, job: asyncio.Future[list[Answer]], watch: ClientWatch, writer: ResponseWriter) -> None:
        await watch.first(job)
        body = self.endpoint.render_choices(self.exchange, job.result())  # the job's exception (a refusal) is raised here
        await self._answer(Response(body, status_code=200), writer)

    async def _stream(self, job: asyncio.Future[None], admitted: asyncio.Event, mailbox: asyncio.Queue[Any],
                      watch: ClientWatch, writer: ResponseWriter) -> None:
        admission = asyncio.ensure_future(admitted.wait())
        try:
            await watch.first(job, admission)
        finally:
            admission.cancel()
        if not admitted.is_set():
            job.result()  # the engine refused the request (or could not be asked): answered with its status
            raise RuntimeError("the stream's job ended before its request was admitted")
        await writer.stream(self.endpoint.stream_format, mailbox)

    async def _pump(self, outputs: list[AsyncIterator[AnswerDelta]], admitted: asyncio.Event,
                    mailbox: asyncio.Queue[Any]) -> None:
        """A stream's job: render the outputs (one stream per choice) as encoded events into the mailbox, in order."""
        encode = ENCODERS[self.endpoint.stream_format]
        events = self.endpoint.render_stream_choices(self.exchange, outputs)
        try:
            async with contextlib.AsyncExitStack() as closing:
                for out in outputs:
                    await closing.enter_async_context(contextlib.aclosing(out))
                try:
                    async for event in events:
                        mailbox.put_nowait(encode(event))
                except Exception:
                    if admitted.is_set():  # named before the outputs are closed, so the abort is counted as such
                        self.record.abort_reason = self.record.abort_reason or "error"
                    raise
                finally:
                    await events.aclose()  # a renderer that stopped early does not leave the request running
        except Exception as exc:
            if not admitted.is_set():
                raise  # a refusal: the status line has not gone out, so it is answered with a status
            for event in self.endpoint.render_stream_error(self.exchange, api_error(exc)):
                mailbox.put_nowait(encode(event))

    async def _answer(self, response: Response[Any], writer: ResponseWriter) -> None:
        """Send a whole Litestar response through the writer (its stall deadline applies)."""
        asgi = response.to_asgi_response(None, self.request)
        await asgi(self.request.scope, self.request.receive, writer.send)  # type: ignore[arg-type]

    async def _client_gone(self, job: asyncio.Future[Any], reason: str, writer: ResponseWriter) -> None:
        """Count the departure, let the policy decide how long the job may go on, and say 499."""
        self.services.metrics.client_left(self.record, reason)
        if reason == SEND_STALL:
            logger.warning("request %s: the client read nothing for %.1f s; closing its connection",
                           self.exchange.id, writer.stall_timeout)
        try:
            await self.services.policy.client_gone(job, reason)
        except Exception:
            logger.exception("disconnect policy %r failed", self.services.policy.name)
        if not writer.started and reason != SEND_STALL:  # only the access log hears it; it must not claim success
            with contextlib.suppress(ClientGone):
                await writer.start(CLIENT_CLOSED_REQUEST, [(b"content-length", b"0")])
                await writer.body(b"", more=False)


async def _collect_all(outputs: list[AsyncIterator[AnswerDelta]]) -> list[Answer]:
    """A unary request's job: every choice's whole generation; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(_collect(out)) for out in outputs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(outputs: AsyncIterator[AnswerDelta]) -> Answer:
    """One choice's whole generation."""
    async with contextlib.aclosing(outputs):
        return Answer.from_deltas([out async for out in outputs])
