"""A router's Prometheus metrics, in its own registry (so that many routers and servers share a process).

Counters are counted as requests pass; the per-replica gauges (in flight, healthy) are read from the
fleet when /metrics is scraped, so they are never out of step with what admission sees.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.router.replicas import Fleet


class FleetCollector(Collector):
    """Per replica: requests in flight through this router, its bound, and whether it is healthy."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        in_flight = GaugeMetricFamily("pagoda_router_in_flight", "Requests in flight through this router, by replica.",
                                      labels=["replica"])
        bound = GaugeMetricFamily("pagoda_router_max_in_flight", "The most requests in flight a replica may hold "
                                  "through this router (--max-queue-per-replica).", labels=["replica"])
        healthy = GaugeMetricFamily("pagoda_router_replica_healthy", "1 while a replica is routed to, else 0.",
                                    labels=["replica"])
        for replica in self.fleet.replicas:
            in_flight.add_metric([replica.url], replica.in_flight)
            bound.add_metric([replica.url], replica.max_in_flight)
            healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
        yield from (in_flight, bound, healthy)
        policy = self.fleet.policy
        reasons = getattr(policy, "reasons", None) if policy.name == "prefix" else None  # its decisions, by why
        if reasons is not None:
            decisions = CounterMetricFamily("pagoda_router_prefix_decisions", "Prefix policy decisions: the longest "
                                            "cached prefix (match), too little of it cached (low_match), none cached "
                                            "(no_match), or loads too far apart (balance).", labels=["reason"])
            for reason in ("match", "low_match", "no_match", "balance"):
                decisions.add_metric([reason], reasons.get(reason, 0))
            yield decisions


class RouterMetrics:
    """pagoda_router_* counters, and the fleet's gauges at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self.policy = fleet.policy.name
        self.requests = Counter("pagoda_router_requests", "Requests sent to a replica, by replica and policy.",
                                ["replica", "policy"], registry=self.registry)
        self.upstream_errors = Counter("pagoda_router_upstream_errors", "Requests a replica failed: unreachable "
                                       "(connect), refused with 503 (unavailable), or cut off mid-answer (broken).",
                                       ["replica", "kind"], registry=self.registry)
        self.queue_full = Counter("pagoda_router_queue_full", "Requests answered 429: every healthy replica was full.",
                                  registry=self.registry)
        self.unavailable = Counter("pagoda_router_unavailable",
                                   "Requests answered 503: no replica was healthy, or the router was draining.",
                                   registry=self.registry)
        self.client_disconnects = Counter("pagoda_router_client_disconnects", "Requests whose client left before "
                                          "its answer was complete (the upstream request was closed).",
                                          registry=self.registry)
        for replica in fleet.replicas:  # every series present from the start, at 0
            self.requests.labels(replica=replica.url, policy=self.policy)
        self.registry.register(FleetCollector(fleet))

    def sent(self, url: str) -> None:
        self.requests.labels(replica=url, policy=self.policy).inc()

    def upstream_error(self, url: str, kind: str) -> None:
        self.upstream_errors.labels(replica=url, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
