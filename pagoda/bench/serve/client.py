"""One request of `pagoda bench serve`, timed from the client's side, and the /metrics split.

Requests go through the endpoints' own client halves and `pagoda.plugins.client.send`, the one client stack:
pagoda's registered endpoints for pagoda, and `OpenAICompatible` for a peer (llama-server, vLLM or any other
OpenAI-compatible server), the same client halves with the fields such servers read besides (llama.cpp's
`n_predict`). So both sides are measured by the same code.

A token event is a stream event that carries text: TTFT is the time to the first one, each later one adds
an inter-token gap (an event holding several tokens is one gap, as a client sees it). The output token count
comes from the usage the server reports where it reports one, else the token events.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagoda.plugins.client import ClientAnswer, ClientRequest, EndpointClient, send
from pagoda.plugins.manager import load_plugins, registered_endpoints

PROTOCOLS = ("completions", "chat")  # the endpoints a load may use, by the protocol names crowds use
SPLIT = ("queue", "prefill", "decode")  # pagoda_request_{name}_seconds
HOPS = ("handoff", "first_token_delivery")  # the same, where the server has them: event loop <-> engine thread
CANCELLED = "cancelled at the run deadline"  # the error of a request cut off while in flight


class OpenAICompatible:
    """A peer's endpoint: an OpenAI endpoint's client half, plus what other OpenAI-compatible servers read."""

    def __init__(self, endpoint: EndpointClient) -> None:
        self.endpoint = endpoint
        self.path, self.stream_format = endpoint.path, endpoint.stream_format

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        # llama.cpp's server reads `n_predict` (and `ignore_eos`, which the client half sends) beside max_tokens
        return {**self.endpoint.client_request(ask), "n_predict": ask.max_tokens}

    def client_answer(self) -> ClientAnswer:
        return self.endpoint.client_answer()


def pagoda_endpoints() -> dict[str, EndpointClient]:
    """The client halves of pagoda's own completions and chat endpoints (its built-in plugins)."""
    endpoints = registered_endpoints(load_plugins({"PAGODA_PLUGINS": "none"}))
    return {name: endpoints[name] for name in PROTOCOLS}


def peer_endpoints() -> dict[str, EndpointClient]:
    """A peer's completions and chat, spoken as OpenAI's."""
    return {name: OpenAICompatible(endpoint) for name, endpoint in pagoda_endpoints().items()}


@dataclass
class Target:
    """One server under load: pagoda, or the peer it is compared with, and the client halves that speak to it."""

    name: str  # "pagoda" | "peer"
    url: str
    model: str = "default"
    api_key: str | None = None
    endpoints: dict[str, EndpointClient] = field(default_factory=pagoda_endpoints)

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """What one request measured; times in seconds."""

    server: str
    level: float  # the concurrency or request rate it ran under
    index: int
    start: float  # since the level began
    conversation: int | None = None
    turn: int | None = None
    tenant: str | None = None  # whose key sent it (--tenant-mix)
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


def ask_for(model: str, prompt: str, max_tokens: int, temperature: float, *, system: str | None = None,
            history: tuple[tuple[str, str], ...] = ()) -> ClientRequest:
    """A streamed request with a fixed output length (`ignore_eos` and max_tokens), as every server gets it."""
    return ClientRequest(prompt=prompt, max_tokens=max_tokens, stream=True, temperature=temperature,
                         ignore_eos=True, model=model, system=system, history=history)


async def stream_request(http: httpx.AsyncClient, target: Target, protocol: str, ask: ClientRequest,
                         record: RequestRecord, timeout: float) -> str:
    """Send one request through the target's client half, read its stream to the end, fill `record`; returns the
    generated text."""
    started = time.perf_counter()
    events: list[float] = []  # when each event that carried text arrived
    answered: list[float] = []  # when the first byte came
    answer = target.endpoints[protocol].client_answer()
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(2):
                try:
                    await send(http, target.endpoints[protocol], ask, base_url=target.url, headers=target.headers,
                               answer=answer, on_first_byte=lambda: answered.append(time.perf_counter()),
                               on_text=lambda: events.append(time.perf_counter()))
                    break
                except httpx.RemoteProtocolError:
                    # A kept-alive connection the server closed as the request went out (llama.cpp's server
                    # closes some after a stream): nothing was answered, so it is sent again once, as the SDKs
                    # retry; the request's clock keeps running from the first send.
                    if answered or attempt:
                        raise
        record.e2e = time.perf_counter() - started
        _token_times(record, started, events)
        record.prompt_tokens = answer.prompt_tokens
        record.output_tokens = answer.output_tokens or len(events)
        record.ok = record.ttft is not None
        if not record.ok:
            record.error = "no token in the stream"
    except asyncio.CancelledError:
        record.error = CANCELLED
        # What streamed before the cut is kept (still not ok): a tenant mix counts the tokens a stopped
        # request had been given while its neighbour was active.
        _token_times(record, started, events)
        record.output_tokens = len(events)
        raise
    except TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # the record says why; the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    return answer.text


def _token_times(record: RequestRecord, started: float, events: list[float]) -> None:
    if events:
        record.ttft = events[0] - started
        record.itl = [b - a for a, b in zip(events, events[1:])]


async def served_model(http: httpx.AsyncClient, target: Target) -> str:
    """The first model id in the server's /v1/models."""
    try:
        resp = await http.get(target.url + "/v1/models", headers=target.headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"{target.url}/v1/models named no model ({type(exc).__name__}: {exc});"
                           " pass --model-name / --peer-model-name") from None


async def scrape_split(http: httpx.AsyncClient, target: Target) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of pagoda's queue/prefill/decode histograms; None for a server without them."""
    try:
        resp = await http.get(target.url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            for name in SPLIT + HOPS:
                base = f"pagoda_request_{name}_seconds"
                if s.name in (base + "_sum", base + "_count"):
                    found.setdefault(name, [0.0, 0.0])[s.name.endswith("_count")] = s.value
    return {k: (v[0], v[1]) for k, v in found.items()} if all(k in found for k in SPLIT) else None


def split_means(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Mean seconds per request of each part, over the requests that finished between two scrapes."""
    if before is None or after is None:
        return None
    means = {}
    for name in [*SPLIT, *(h for h in HOPS if h in before and h in after)]:
        total, count = after[name][0] - before[name][0], after[name][1] - before[name][1]
        means[name] = total / count if count else None
    return means
