"""The pass-through: every request that is not the router's own goes to one replica, and its answer comes back.

Design note. One exchange, as raw ASGI (the router mounts it under Litestar):

1. the request body is read whole (over `max_body_bytes`: 413), so that a policy may read it and a
   request a replica never took can go to another;
2. with `--api-key`, a guarded path is checked by pagoda's own guard (401 in the path's shape); for a
   policy that keys on the prompt (`prefix`), the prompt is read (router/prompts.py);
3. from here the exchange races its client (`race_client`): a task waits on `receive()` for
   `http.disconnect` while the forwarding runs. A client that leaves before its answer went out whole
   cancels the forwarding,
   whose `finally` closes the upstream response, so the replica's connection closes and the replica
   aborts the job as it does for any client that leaves (docs/disconnects.md). One place, whatever the
   stage: waiting for the replica's first byte (a queue, a prefill), mid-stream, or mid-body;
4. `Fleet.admit` picks the replica (429 when every healthy one is full, 503 when none is healthy) and
   counts the request in flight there until the exchange ends;
5. the request goes up with its headers (less the hop-by-hop ones) and body; the answer comes back with
   its status and headers (content-type, retry-after, ...; plus `x-pagoda-replica`, the replica's URL).
   A stream (text/event-stream, NDJSON) is relayed as its chunks arrive, whole events at a time; any
   other answer is read whole, then sent.

Failures. A replica that cannot be reached, or that answers 503 (draining, or an engine that cannot
serve), did not take the job: it is marked unhealthy and the request goes to another (or is refused as
in 4). A replica that fails after it took the request (its connection reset or closed mid-answer) is
not retried, as the job may have run: a unary request gets a 502 in the protocol's error shape, and a
stream that had begun gets the protocol's in-stream error event after the last whole event, then ends.
The router does not retry, reorder or rewrite anything else: a replica's own answers (400, 401, 404,
429, its in-stream errors) pass through as they are.

LoRA adapters. A generation request whose `model` names an adapter goes only to replicas whose /health lists
it (Fleet.admit). An adapter's load or unload (vLLM's `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`)
goes to every healthy replica at once (`_fan_out`), so that the fleet serves one set of adapters: 200 (the first
replica's answer) when every one answered 2xx; otherwise the first failing replica's status and error body, to
which the router adds which replicas changed (`replicas`: each one's URL, status and whether it `changed`; the
message says it too), as a replica that succeeded stays changed. The replicas' /health is read again before the
answer goes out, so the next request for the adapter is routed by what the fan-out did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx
import msgspec
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.types import Receive, Scope, Send

from pagoda.api.http_errors import error_response, http_error
from pagoda.api.tenants import TenantTable
from pagoda.plugins.protocol import ApiError
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policy import RequestInfo
from pagoda.router.prompts import PromptReader, body_adapter
from pagoda.router.replicas import Fleet, Refused, Replica
from pagoda.router.routes import PathInfo, RouteTable
from pagoda.router.settings import RouterSettings

logger = logging.getLogger("pagoda.router")
access_log = logging.getLogger("pagoda.router.access")  # one line a request: status (499: the client left), replica

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
REQUEST_DROPPED = HOP_BY_HOP | {"host", "content-length", "expect"}  # httpx sets host and length itself
RESPONSE_DROPPED = HOP_BY_HOP | {"content-length", "date", "server"}  # uvicorn writes its own
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
REPLICA_HEADER = b"x-pagoda-replica"  # on every forwarded answer: which replica served it
# vLLM's routes that load and unload a LoRA adapter (pagoda.api.adapters): sent to every healthy replica
ADAPTER_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class NotTaken(Exception):
    """The replica did not take the request (unreachable, or it answered 503): another one may."""


@dataclass(frozen=True)
class ReplicaAnswer:
    """One replica's whole answer to a request the router sent to every replica."""

    replica: Replica
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    @property
    def changed(self) -> bool:
        return 200 <= self.status < 300


class Proxy:
    """The ASGI app the router mounts for every path it does not answer itself."""

    def __init__(self, fleet: Fleet, table: RouteTable, metrics: RouterMetrics, settings: RouterSettings,
                 tenants: TenantTable, prompts: PromptReader | None = None) -> None:
        self.fleet = fleet
        self.prompts = prompts  # reads each request's prompt, for a policy that keys on it
        self.table = table
        self.metrics = metrics
        self.max_body_bytes = settings.max_body_bytes
        self.health_timeout = settings.health_timeout
        self.guard = tenants.guard if tenants.needs_key else None  # the replicas' keys, checked as they check them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # pagoda serves no WebSocket; uvicorn refuses the upgrade when the app returns
        raw_path = scope["raw_path"].split(b"?", 1)[0]  # the mount rewrites scope["path"]; raw_path is the client's
        path = unquote(raw_path.decode("latin-1"))
        info = self.table.lookup(path)
        body = await read_body(receive, self.max_body_bytes)
        if body is None:
            return  # the client left before its request arrived: nothing was sent anywhere
        if body is TOO_LARGE:
            await send_error(send, info, ApiError(413, f"the request body is over {self.max_body_bytes} bytes"))
            return
        everywhere = scope["method"] == "POST" and path in ADAPTER_ROUTES
        if self.guard is not None and (info.guarded or everywhere):
            try:
                self.guard(ASGIConnection(scope), None)  # type: ignore[arg-type]  (pagoda's guard ignores the handler)
            except NotAuthorizedException as exc:
                await send_error(send, info, http_error(exc))
                return
        target = raw_path + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        if everywhere:
            await self._fan_out(scope, send, info, RequestInfo(scope["method"], path, None, body),
                                target.decode("latin-1"))
            return
        prompt = None
        if self.prompts is not None and info.endpoint is not None:  # off the loop: it relays every other stream
            prompt = await asyncio.to_thread(self.prompts.read, info.endpoint, body, scope)
        adapter = prompt.adapter if prompt is not None else (
            body_adapter(body, self.fleet.adapter_names()) if info.endpoint is not None else None)
        request = RequestInfo(scope["method"], path, info.protocol, body, prompt, adapter)
        answer = AnswerWatch(send)
        forwarding = self._forward(scope, answer.send, info, request, target.decode("latin-1"))
        started = time.monotonic()
        left = await race_client(receive, answer, forwarding)
        if left:
            self.metrics.client_disconnects.inc()
        access_log.info('"%s %s" %s %.1fms replica=%s', request.method, path, 499 if left else answer.status,
                        1000 * (time.monotonic() - started), answer.replica or "-")

    async def _forward(self, scope: Scope, send: Send, info: PathInfo, request: RequestInfo, target: str) -> None:
        """Admit the request on a replica and relay its answer; a replica that did not take it passes it on."""
        tried: set[int] = set()
        while True:
            try:
                with self.fleet.admit(request, frozenset(tried)) as replica:
                    self.metrics.sent(replica.url)
                    try:
                        await self._exchange(replica, scope, send, info, request, target)
                        return
                    except NotTaken:
                        tried.add(replica.index)
            except Refused as refused:
                (self.metrics.queue_full if refused.status == 429 else self.metrics.unavailable).inc()
                await send_error(send, info, ApiError(refused.status, refused.message, None, refused.code))
                return

    async def _fan_out(self, scope: Scope, send: Send, info: PathInfo, request: RequestInfo, target: str) -> None:
        """Send the request to every healthy replica at once, then answer for all of them (the module's note)."""
        started = time.monotonic()
        try:
            with self.fleet.admit_all() as replicas:
                answers = await asyncio.gather(*(self._ask(r, scope, info, request, target) for r in replicas))
                await self.fleet.refresh(replicas, self.health_timeout)  # what the fan-out changed, before the answer
        except Refused as refused:
            (self.metrics.queue_full if refused.status == 429 else self.metrics.unavailable).inc()
            await send_error(send, info, ApiError(refused.status, refused.message, None, refused.code))
            return
        failed = [a for a in answers if not a.changed]
        answer = failed[0] if failed else answers[0]
        body = answer.body if not failed else with_replicas(answer, answers, info)
        urls = ", ".join(a.replica.url for a in (answers if not failed else [answer]))
        rewritten = (REPLICA_HEADER, b"content-length") + ((b"content-type",) if failed else ())
        headers = [*[(k, v) for k, v in answer.headers if k not in rewritten], (REPLICA_HEADER, urls.encode()),
                   *([(b"content-type", b"application/json")] if failed else []),
                   (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        access_log.info('"%s %s" %s %.1fms replicas=%s changed=%d', request.method, request.path, answer.status,
                        1000 * (time.monotonic() - started), len(answers), len(answers) - len(failed))

    async def _ask(self, replica: Replica, scope: Scope, info: PathInfo, request: RequestInfo,
                   target: str) -> ReplicaAnswer:
        """One replica's whole answer to the request; a replica that cannot answer is a 502 in the path's shape."""
        assert replica.client is not None, "the router's start-up opens each replica's client"
        self.metrics.sent(replica.url)
        try:
            response = await replica.client.request(request.method, replica.url + target,
                                                    headers=forward_headers(scope), content=request.body)
        except httpx.HTTPError as exc:
            connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            self._failed(replica, "connect" if connect else "broken", "unreachable", exc)
            error = error_response(info.errors, ApiError(502, f"the replica at {replica.url} did not answer: "
                                                              f"{type(exc).__name__}"))
            return ReplicaAnswer(replica, 502, [(b"content-type", b"application/json")],
                                 msgspec.json.encode(error.content))
        if response.status_code == 503:
            self._failed(replica, "unavailable", "unavailable", "it answered 503")
        return ReplicaAnswer(replica, response.status_code, answer_headers(response, replica), response.content)

    async def _exchange(self, replica: Replica, scope: Scope, send: Send, info: PathInfo, request: RequestInfo,
                        target: str) -> None:
        """One request to one replica, its answer relayed; NotTaken when the replica did not take it."""
        assert replica.client is not None, "the router's start-up opens each replica's client"
        upstream = replica.client.build_request(request.method, replica.url + target, headers=forward_headers(scope),
                                                content=request.body)
        try:
            response = await replica.client.send(upstream, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._failed(replica, "connect", "unreachable", exc)
            raise NotTaken from exc
        except httpx.HTTPError as exc:  # it had the request, then failed before its answer began
            self._failed(replica, "broken", "unreachable", exc)
            await send_error(send, info, ApiError(502, f"the replica at {replica.url} failed before it answered: "
                                                       f"{type(exc).__name__}"))
            return
        try:
            if response.status_code == 503:
                self._failed(replica, "unavailable", "unavailable", "it answered 503")
                raise NotTaken
            headers = answer_headers(response, replica)
            if response.headers.get("content-type", "").startswith(STREAM_TYPES):
                await self._relay_stream(replica, response, headers, send, info)
            else:
                await self._relay_whole(replica, response, headers, send, info)
        finally:
            await response.aclose()  # mid-answer (the client left, or a failure) this closes the connection

    async def _relay_stream(self, replica: Replica, response: httpx.Response, headers: list[tuple[bytes, bytes]],
                            send: Send, info: PathInfo) -> None:
        """Status and headers at once, then whole events as they arrive; a break ends with the protocol's error."""
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        end, pending, num_events = info.event_end, b"", 0
        try:
            async for chunk in response.aiter_raw():
                if end is None:
                    out = chunk
                else:  # hold back a partial event, so that an error event never lands inside one
                    data = pending + chunk
                    cut = data.rfind(end) + len(end) if end in data else 0
                    out, pending = data[:cut], data[cut:]
                    num_events += count_events(out, info)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except httpx.HTTPError as exc:
            self._failed(replica, "broken", "unreachable", exc)
            error = ApiError(502, f"the replica at {replica.url} failed mid-stream: {type(exc).__name__}")
            await send({"type": "http.response.body", "body": info.stream_error(error, num_events), "more_body": False})
            return
        await send({"type": "http.response.body", "body": pending, "more_body": False})

    async def _relay_whole(self, replica: Replica, response: httpx.Response, headers: list[tuple[bytes, bytes]],
                           send: Send, info: PathInfo) -> None:
        """The whole answer read, then sent: a replica that fails mid-answer is a clean 502."""
        try:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
        except httpx.HTTPError as exc:
            self._failed(replica, "broken", "unreachable", exc)
            await send_error(send, info, ApiError(502, f"the replica at {replica.url} failed mid-answer: "
                                                       f"{type(exc).__name__}"))
            return
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _failed(self, replica: Replica, kind: str, status: str, error: BaseException | str) -> None:
        self.metrics.upstream_error(replica.url, kind)
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        replica.mark_down(status, text)
        logger.warning("replica %s: %s (%s)", replica.url, text, kind)


def with_replicas(failure: ReplicaAnswer, answers: list[ReplicaAnswer], info: PathInfo) -> bytes:
    """A failing replica's error body, saying which replicas the request changed: a `replicas` list (URL, status,
    changed) beside the error, and the same in words after its message. A body that is not a JSON object becomes
    an error in the path's shape holding its text."""
    changed = [a.replica.url for a in answers if a.changed]
    said = (f" (sent to every healthy replica: changed on {', '.join(changed)}; not on the others)" if changed
            else " (sent to every healthy replica: none changed)")
    try:
        body = msgspec.json.decode(failure.body)
    except msgspec.DecodeError:
        body = None
    if not isinstance(body, dict):
        text = failure.body.decode("utf-8", "replace")[:1000]
        body = dict(error_response(info.errors, ApiError(failure.status, text)).content)
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        body["error"] = {**error, "message": error["message"] + said}
    body["replicas"] = [{"url": a.replica.url, "status": a.status, "changed": a.changed} for a in answers]
    return msgspec.json.encode(body)


def count_events(whole_events: bytes, info: PathInfo) -> int:
    """How many events (not SSE comments such as keep-alives) these whole events of the path's stream hold."""
    if info.stream_format == "ndjson":
        return whole_events.count(b"\n")
    return whole_events.count(b"\ndata:") + whole_events.startswith(b"data:")


class _TooLarge:
    pass


TOO_LARGE = _TooLarge()  # read_body: the body is over the limit


async def read_body(receive: Receive, limit: int) -> bytes | _TooLarge | None:
    """The request body; TOO_LARGE past `limit` bytes; None when the client left before it arrived."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            return TOO_LARGE
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


class AnswerWatch:
    """Passes an answer's messages to `send`, noting its status, which replica gave it, and when it went out whole."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None
        self.replica: str | None = None
        self.complete = False

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.replica = next((v.decode() for k, v in message["headers"] if k == REPLICA_HEADER), None)
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


async def race_client(receive: Receive, answer: AnswerWatch, forwarding: Any) -> bool:
    """Run the forwarding to its end unless the client leaves before its answer is complete; then cancel it
    (its `finally` closes the upstream request). Returns whether the client left."""
    work = asyncio.ensure_future(forwarding)
    gone = asyncio.ensure_future(client_gone(receive))
    left = False
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        # uvicorn also says http.disconnect once the answer went out whole: that is not a client leaving
        if not work.done() and not answer.complete:
            left = True
            work.cancel()
        await asyncio.wait((work,))  # let it tidy up (close the upstream response, free its slot)
    finally:
        for task in (work, gone):
            task.cancel()  # no-ops unless the router itself is being cancelled (shutdown)
        await asyncio.gather(work, gone, return_exceptions=True)
    if not left:
        work.result()  # an unexpected error is the app's to report
    return left


async def client_gone(receive: Receive) -> None:
    """Returns once the client has disconnected (every other message is ignored: a pipelined request is not a
    disconnect). Started only after the body was read, or it would swallow the body's messages."""
    while (await receive())["type"] != "http.disconnect":
        pass


def forward_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers as the replica gets them: less the hop-by-hop ones, plus X-Forwarded-For."""
    headers = [(name, value) for name, value in scope["headers"]
               if name.decode("latin-1").lower() not in REQUEST_DROPPED]
    client = scope.get("client")
    if client:
        before = [value for name, value in headers if name.lower() == b"x-forwarded-for"]
        headers = [(name, value) for name, value in headers if name.lower() != b"x-forwarded-for"]
        headers.append((b"x-forwarded-for", b", ".join([*before, str(client[0]).encode()])))
    return headers


def answer_headers(response: httpx.Response, replica: Replica) -> list[tuple[bytes, bytes]]:
    """The replica's headers as the client gets them: less the hop-by-hop ones, plus which replica it was."""
    headers = [(name.lower(), value) for name, value in response.headers.raw
               if name.decode("latin-1").lower() not in RESPONSE_DROPPED]
    return [*headers, (REPLICA_HEADER, replica.url.encode())]


async def send_error(send: Send, info: PathInfo, error: ApiError) -> None:
    """An error the router answers itself, in the path's shape, with pagoda's headers (retry-after, ...)."""
    response = error_response(info.errors, error)
    body = msgspec.json.encode(response.content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((name.encode(), value.encode()) for name, value in (response.headers or {}).items())]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
