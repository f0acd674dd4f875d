"""`glmserve_gateway_*` metrics of the proxy: upstream requests by backend and status, retries, timeouts, cut
streams, routing rules, upstream latency; breaker, health, in-flight and reported load per backend are read
from the pool at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from glmserve.gateway.backends import BackendPool
from glmserve.gateway.metrics import Children
from glmserve.gateway.workers import multiprocess_metrics

PREFIX = "glmserve_gateway"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    def __init__(self, pool: BackendPool, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self.upstream = Children(Counter(f"{PREFIX}_upstream_requests", "Requests sent to a backend, by backend and "
                                         "outcome (HTTP status, connect_error, transport_error, timeout)",
                                         ["backend", "status"], registry=reg))
        self.responses = Children(Counter(f"{PREFIX}_responses", "Answers to clients by HTTP status", ["status"],
                                          registry=reg))
        self.retries = Counter(f"{PREFIX}_retries", "Requests sent again to another backend, by reason", ["reason"],
                               registry=reg)
        self.retries_refused = Counter(f"{PREFIX}_retries_refused", "Retries not made (retry budget or limit spent)",
                                       registry=reg)
        self.timeouts = Counter(f"{PREFIX}_timeouts", "Upstream timeouts by kind", ["kind"], registry=reg)
        self.stream_errors = Counter(f"{PREFIX}_stream_errors", "Streams ended with an error event, by reason",
                                     ["reason"], registry=reg)
        self.routed = Children(Counter(f"{PREFIX}_routed", "Routing decisions by rule (session, prefix, least_loaded) "
                                       "and whether a standby took the request", ["rule", "role"], registry=reg))
        self.first_byte = Children(Histogram(f"{PREFIX}_upstream_first_byte_seconds", "Time to a backend's first byte "
                                             "(the whole answer when not streamed)", ["backend"],
                                             buckets=LATENCY_BUCKETS, registry=reg))
        self.duration = Children(Histogram(f"{PREFIX}_upstream_duration_seconds", "Time to a backend's last byte",
                                           ["backend"], buckets=LATENCY_BUCKETS, registry=reg))
        # collectors that read live state at scrape time (the pool's; the admission middleware adds its own)
        self.live: list[Collector] = [_PoolCollector(pool)]
        reg.register(self.live[0])

    def render(self) -> tuple[bytes, str]:
        """The registry's metrics; in a worker of `--workers N`, the counters and histograms summed over every
        worker (prometheus_client's multiprocess files) and the live gauges of this worker."""
        if not multiprocess_metrics():
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        for collector in self.live:
            registry.register(collector)
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {
            "backend_healthy": ("1 when the active probes find the backend healthy", lambda b: b.healthy),
            "breaker_state": ("Circuit breaker: 0 closed, 1 half-open, 2 open", lambda b: int(b.breaker.state)),
            "backend_in_flight": ("Requests this gateway has open on the backend", lambda b: b.in_flight),
            "backend_reported_load": ("Running + waiting requests the backend's /metrics reports",
                                      lambda b: b.reported_load),
        }
        for name, (doc, value) in families.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["backend", "role"])
            for b in self._pool.backends.values():
                family.add_metric([b.url, "standby" if b.standby else "active"], float(value(b)))
            yield family
        opened = CounterMetricFamily(f"{PREFIX}_breaker_opened", "Times the breaker opened", labels=["backend", "role"])
        for b in self._pool.backends.values():
            opened.add_metric([b.url, "standby" if b.standby else "active"], float(b.breaker.times_opened))
        yield opened
