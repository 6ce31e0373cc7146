"""Prometheus metrics of one server, in its own registry (so that many servers share a process).

Latencies and token counts are observed per request, as its outputs pass
through `observe`. Queue sizes, the KV pool and the engine's counters are read
from the engine loop's stats when /metrics is scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.core.async_engine import EngineDeadError, GenerationError, RequestAborted
from pagoda.core.outputs import AnswerDelta
from pagoda.core.scheduler import QueueFull

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class AccessRecord:
    """What the access log says about one request besides method, path, status and time."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Why the client counts as gone, if it left before its response was complete: "client_disconnect"
    # (the connection closed or a write failed) or "send_stall" (it stopped reading). Such a request
    # is logged as 499, also when a stream had already sent its 200.
    client_gone: str | None = None
    tenant: str | None = None  # the tenant's name (never its key), once the key is matched
    # Why the engine request ended early, if it did. The consumer of `Metrics.observe` sets it before
    # closing the outputs for a reason of its own (e.g. "error"); a request cancelled after its client
    # left gets the client's reason, one cancelled for no recorded reason (shutdown) "cancelled".
    abort_reason: str | None = None


class EngineCollector(Collector):
    """Gauges and counters from the engine loop's latest stats (set just before each scrape)."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats
        if not s:
            return
        yield _gauge("pagoda_requests_running", "Requests running in the scheduler now.", s["running"])
        yield _gauge("pagoda_requests_waiting", "Requests waiting in the scheduler now.", s["waiting"])
        yield _gauge("pagoda_kv_blocks_total", "KV cache blocks in the pool.", s["kv_blocks_total"])
        yield _gauge("pagoda_kv_blocks_free", "KV cache blocks free now.", s["kv_blocks_free"])
        used = 1.0 - s["kv_blocks_free"] / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0
        yield _gauge("pagoda_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", used)
        yield _counter("pagoda_preemptions", "Requests preempted (KV freed, recomputed later).", s["preemptions_total"])
        yield _counter("pagoda_recomputed_tokens", "Tokens recomputed after preemption.", s["recomputed_tokens_total"])
        yield _counter("pagoda_engine_requests", "Requests the engine admitted.", s["requests_total"])
        yield _counter("pagoda_engine_aborted_requests", "Requests the engine aborted.", s["aborted_total"])
        # The prefix cache: its hit rate is hits / queries.
        yield _counter("pagoda_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
                       s["prefix_cache_queried_tokens_total"])
        yield _counter("pagoda_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
                       s["prefix_cache_hit_tokens_total"])
        yield _gauge("pagoda_kv_blocks_cached_free", "Free KV blocks that still hold a cached prefix (evictable).",
                     s["kv_blocks_cached_free"])
        # Speculative decoding (n-gram drafts in the padded rows): its acceptance rate is accepted / draft.
        yield _counter("pagoda_spec_decode_draft_tokens", "Draft tokens proposed for verification.",
                       s.get("spec_decode_draft_tokens_total", 0))
        yield _counter("pagoda_spec_decode_accepted_tokens", "Draft tokens accepted (equal to the greedy token).",
                       s.get("spec_decode_accepted_tokens_total", 0))
        # LoRA adapters: resident memory beside the weights and the KV pool.
        yield _gauge("pagoda_lora_adapters_loaded", "LoRA adapters loaded now.", s.get("lora_adapters_loaded", 0))
        yield _gauge("pagoda_lora_adapter_bytes", "Bytes the loaded LoRA adapters' weights hold.",
                     s.get("lora_adapter_bytes", 0))
        yield _gauge("pagoda_lora_adapters_in_use", "LoRA adapters with requests in flight now.",
                     s.get("lora_adapters_in_use", 0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Metrics:
    """The metrics of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pagoda_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("pagoda_inter_token_latency_seconds", "Time between two tokens of a request.",
                                     buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda_e2e_request_latency_seconds", "Time from arrival to a finished request's end.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # The server side of a request's latency, from the engine's own stamps (RequestTimes), when it finishes.
        self.queue = Histogram("pagoda_request_queue_seconds", "Time from arrival to the request's first step.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("pagoda_request_prefill_seconds", "Time from the first step to the first token.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("pagoda_request_decode_seconds", "Time from the first token to the request's end.",
                                buckets=_LATENCY_BUCKETS, registry=r)
        # Around the engine's stamps, the hops between the event loop and the engine thread (same clock, monotonic).
        self.handoff = Histogram("pagoda_request_handoff_seconds", "Time from the handler submitting the request to"
                                 " the engine thread taking it (it waits for the step in progress, and for a"
                                 " constrained request's grammar compile).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.delivery = Histogram("pagoda_request_first_token_delivery_seconds", "Time from the end of the step that"
                                  " sampled the first token to its output reaching the event loop.",
                                  buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagoda_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("pagoda_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("pagoda_requests_finished", "Requests that ran to their end, by finish reason.",
                                ["reason"], registry=r)
        self.aborted = Counter("pagoda_requests_aborted", "Requests that ended early, by reason.", ["reason"],
                               registry=r)
        self.departures = Counter("pagoda_client_departures", "Clients that left before their response was complete,"
                                  " by reason (whatever the disconnect policy then did).", ["reason"], registry=r)
        # Refused before reaching the engine, or by its full queue: queue_full, draining, engine_unavailable,
        # body_too_large, headers_too_large, tenant_limit.
        self.rejected = Counter("pagoda_requests_rejected", "Requests refused for load or limits, by reason.",
                                ["reason"], registry=r)
        # Per tenant (pagoda.api.tenants): label values are the keys file's names only (bounded); a server
        # without a keys file has one, "default". Reasons: max_concurrent, requests_per_minute, tokens_per_minute.
        self.tenant_requests = Counter("pagoda_tenant_requests", "Requests admitted, by tenant.", ["tenant"],
                                       registry=r)
        self.tenant_rejected = Counter("pagoda_tenant_rejected", "Requests refused for a tenant's limits, by tenant"
                                       " and limit.", ["tenant", "reason"], registry=r)
        self.tenant_tokens = Counter("pagoda_tenant_tokens", "Tokens charged to a tenant, by kind (prompt,"
                                     " completion).", ["tenant", "kind"], registry=r)
        self.tenant_in_flight = Gauge("pagoda_tenant_requests_in_flight", "A tenant's requests in flight now.",
                                      ["tenant"], registry=r)
        self.engine = EngineCollector()
        r.register(self.engine)

    def render(self, stats: dict[str, int]) -> bytes:
        """The Prometheus text exposition, with the engine's numbers as of `stats`."""
        self.engine.stats = stats
        return generate_latest(self.registry)

    async def observe(self, outputs: AsyncIterator[AnswerDelta],
                      record: AccessRecord) -> AsyncIterator[AnswerDelta]:
        """Pass a request's outputs through, timing them; an early end is counted by its reason."""
        start = last = time.monotonic()
        first_at = None  # when the first token's output reached this loop
        finished = False
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    now = time.monotonic()
                    if record.completion_tokens == 0 and out.new_token_ids:
                        self.ttft.observe(now - start)
                        first_at = now
                        self.prompt_tokens.inc(out.num_prompt_tokens)
                    elif out.new_token_ids:
                        self.inter_token.observe(now - last)
                    last = now
                    self.generation_tokens.inc(len(out.new_token_ids))
                    record.prompt_tokens, record.completion_tokens = out.num_prompt_tokens, out.num_output_tokens
                    if out.finished:
                        finished = True
                        self.e2e.observe(now - start)
                        self.finished.labels(reason=out.finish_reason.value).inc()
                        self._split(out, start, first_at)
                    yield out
            except (asyncio.CancelledError, GeneratorExit):
                if not finished:
                    self._aborted(record, record.abort_reason or record.client_gone or "cancelled")
                raise
            except (RequestAborted, EngineDeadError):
                self._aborted(record, "server")
                raise
            except GenerationError:
                self._aborted(record, "model_error")
                raise
            except QueueFull:
                self.rejected.labels(reason="queue_full").inc()
                raise
            # Anything else came from admission: a refused request is not an aborted one.

    def _split(self, out: AnswerDelta, submitted: float, first_at: float | None) -> None:
        times = out.times
        if times is None or times.queue_seconds is None or times.decode_seconds is None:
            return
        self.handoff.observe(max(0.0, times.arrival - submitted))
        if first_at is not None and times.first_token is not None:
            self.delivery.observe(max(0.0, first_at - times.first_token))
        self.queue.observe(times.queue_seconds)
        self.prefill.observe(times.prefill_seconds)
        self.decode.observe(times.decode_seconds)

    def client_left(self, record: AccessRecord, reason: str) -> None:
        """Note that the request's client is gone (before its engine request is cancelled, if it is)."""
        if record.client_gone is None:
            record.client_gone = reason
            self.departures.labels(reason=reason).inc()

    def _aborted(self, record: AccessRecord, reason: str) -> None:
        record.abort_reason = reason
        self.aborted.labels(reason=reason).inc()
