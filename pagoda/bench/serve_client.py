"""One streamed request to an OpenAI-compatible server, timed from the client's side, and the /metrics split.

A token event is a stream chunk whose choice carries text: TTFT is the time to
the first one, each later one adds an inter-token gap (a chunk holding several
tokens is one gap, as a client sees it). The output token count comes from
the stream's usage chunk where the server sends one, else the token events.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SPLIT = ("queue", "prefill", "decode")  # pagoda_request_{name}_seconds
HOPS = ("handoff", "first_token_delivery")  # the same, where the server has them: event loop <-> engine thread


@dataclass
class Target:
    """One server under load: pagoda, or the peer it is compared with."""

    name: str  # "pagoda" | "peer"
    url: str
    model: str = "default"
    api_key: str | None = None

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


def request_body(endpoint: str, model: str, text: str | list[dict[str, str]], max_tokens: int,
                 temperature: float) -> dict[str, Any]:
    """A streamed request with a fixed output length (`ignore_eos`; llama.cpp's server reads `n_predict`)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n_predict": max_tokens, "ignore_eos": True,
                            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return body


def _event_text(endpoint: str, data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return (choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")) or ""


async def stream_request(http: httpx.AsyncClient, target: Target, endpoint: str, body: dict[str, Any],
                         record: RequestRecord, timeout: float) -> str:
    """Send one request, read its stream to [DONE], fill `record`; returns the generated text."""
    parts: list[str] = []
    started = time.perf_counter()
    last = None
    events = 0
    try:
        async with asyncio.timeout(timeout):
            async with http.stream("POST", target.url + PATHS[endpoint], json=body, headers=target.headers) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        raise RuntimeError(f"error event: {data['error']}")
                    if usage := data.get("usage"):
                        record.prompt_tokens = usage.get("prompt_tokens")
                        record.output_tokens = usage.get("completion_tokens")
                    if text := _event_text(endpoint, data):
                        now = time.perf_counter()
                        if last is None:
                            record.ttft = now - started
                        else:
                            record.itl.append(now - last)
                        last, events = now, events + 1
                        parts.append(text)
                else:
                    raise RuntimeError("the stream ended without [DONE]")
        record.e2e = time.perf_counter() - started
        record.output_tokens = record.output_tokens or events
        record.ok = record.ttft is not None
        if not record.ok:
            record.error = "no token in the stream"
    except asyncio.CancelledError:
        record.error = "cancelled at the run deadline"
        raise
    except TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # the record says why; the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    return "".join(parts)


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
