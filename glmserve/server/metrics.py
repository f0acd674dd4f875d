"""Prometheus metrics of the server and the engine, in one registry per app.

Request-level numbers (latencies, token counts, finish reasons) are recorded by a
`RequestTracker` per engine request; engine gauges (running/waiting requests, KV-cache usage,
prefix-cache hit rate) are read from the engine's latest stats at scrape time, as is the
truncation rate (share of finished choices that stopped on `length`). KV kept below the device pool
(host and disk tiers, the session store) is read at scrape time too: counters of what moved and
gauges of the bytes held (`StorageStats`, glmserve/engine/outputs.py); they are absent when that storage is off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve.engine.outputs import RequestOutput, StorageStats

if TYPE_CHECKING:
    from glmserve.engine.async_engine import AsyncEngine

PREFIX = "glmserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
TRACKED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/usage"})
# counter name (without _total) -> (stats field, help), for glmserve/kv/tiers.py TierStats
TIER_COUNTERS = {
    "kv_tier_saved_chunks": ("saved_chunks", "KV chunks copied out of the device pool into the host or disk tier"),
    "kv_tier_loaded_chunks": ("loaded_chunks", "KV chunks loaded back into the device pool from the host or disk tier"),
    "kv_tier_loaded_tokens": ("loaded_tokens", "Prompt tokens whose KV was loaded from the host or disk tier"),
    "kv_tier_failed_loads": ("failed_loads", "KV chunks missing or corrupt when loaded from a tier (recomputed)"),
    "kv_tier_failed_writes": ("failed_writes", "KV chunks the disk tier could not write (budget, disk full, file "
                                               "size limit): recomputed when needed"),
    "kv_tier_demoted_chunks": ("demoted_chunks", "KV chunks moved down from the host tier to the disk tier"),
    "kv_tier_save_seconds": ("save_seconds", "Seconds engine steps spent copying chunks out of the device pool"),
    "kv_tier_write_seconds": ("write_seconds", "Seconds the disk writer thread spent writing chunks"),
    "kv_tier_load_seconds": ("load_seconds", "Seconds spent loading chunks back into the device pool"),
}
# the same for glmserve/kv/offload.py OffloadStats (KV offload of sequences longer than the pool)
OFFLOAD_COUNTERS = {
    "kv_stream_offloaded_chunks": ("offloaded_chunks", "KV chunks of running sequences moved out of the device pool"),
    "kv_stream_offload_seconds": ("offload_seconds", "Seconds engine steps spent copying chunks out"),
    "kv_stream_read_slices": ("read_slices", "Offloaded chunk layer slices read back by attention"),
    "kv_stream_skipped_slices": ("skipped_slices", "Offloaded chunk layer slices sparse decode did not need to read"),
    "kv_stream_wait_seconds": ("read_wait_seconds", "Seconds attention waited for offloaded layer slices"),
}
# the same for glmserve/kv/session_io.py SessionStats
SESSION_COUNTERS = {
    "session_restores": ("restores", "Session requests whose prompt went past the device prefix cache, so the "
                                     "session store was read"),
    "session_restore_misses": ("restore_misses", "Session store reads that found nothing usable (unknown or expired "
                                                 "session, other tokens, missing or corrupt chunk)"),
    "session_restored_chunks": ("restored_chunks", "Session KV chunks loaded into the device pool"),
    "session_restored_tokens": ("restored_tokens", "Prompt tokens whose KV was loaded from the session store"),
    "session_restore_read_seconds": ("restore_read_seconds", "Seconds reader threads spent reading and verifying "
                                                             "session KV (off the engine thread)"),
    "session_restore_load_seconds": ("restore_load_seconds", "Seconds engine steps spent copying restored session "
                                                             "KV into the device pool"),
    "session_saves": ("saves", "Session turns whose KV was written to the session store"),
    "session_saved_chunks": ("saved_chunks", "Session KV chunks written to the session store"),
    "session_saved_bytes": ("saved_bytes", "Bytes of session KV written to the session store"),
    "session_save_failures": ("save_failures", "Session saves the store refused (full) or that failed"),
    "session_save_seconds": ("save_seconds", "Seconds the session writer thread spent writing KV"),
}


class ServerMetrics:
    """Every metric the server exports."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=reg
        )
        self.finished = Counter(
            f"{PREFIX}_request_finished", "Finished choices by finish reason", ["finish_reason"], registry=reg
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between successive outputs of a request",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=reg
        )
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "Arrival to first scheduled step",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", registry=reg)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=reg)
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=reg
        )
        self.finished_by_limit = Counter(
            f"{PREFIX}_request_finished_by_limit", "Finished choices by finish reason and by what set their "
            "max_tokens (client, context, server_cap)", ["finish_reason", "limit_source"], registry=reg
        )
        self.budget_lost = Counter(
            f"{PREFIX}_output_budget_lost_tokens", "Completion tokens a server cap took from what the client asked "
            "(counted for choices the cap stopped: finish_reason length)", registry=reg
        )
        self.finish_counts: dict[str, int] = {}
        reg.register(_EngineCollector(engine, self))
        reg.register(_StorageCollector(engine))

    def track(self, limit_source: str = "client", budget_lost: int = 0) -> RequestTracker:
        return RequestTracker(self, limit_source, budget_lost)

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def record_finish(self, reason: str, limit_source: str = "client", budget_lost: int = 0) -> None:
        self.finished.labels(reason).inc()
        self.finished_by_limit.labels(reason, limit_source).inc()
        if reason == "length" and limit_source == "server_cap":
            self.budget_lost.inc(budget_lost)
        self.finish_counts[reason] = self.finish_counts.get(reason, 0) + 1

    def truncation_rate(self) -> float:
        total = sum(self.finish_counts.values())
        return self.finish_counts.get("length", 0) / total if total else 0.0


class RequestTracker:
    """Latency and token accounting of one engine request, fed with its outputs in order."""

    def __init__(self, metrics: ServerMetrics, limit_source: str = "client", budget_lost: int = 0) -> None:
        self._m = metrics
        self._limit_source = limit_source
        self._budget_lost = budget_lost
        self.arrival = time.monotonic()
        self._last: float | None = None
        self._tokens = 0
        self._queued = True
        self._done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if self._queued and output.first_scheduled_time is not None:
            self._queued = False
            self._m.queue_time.observe(output.first_scheduled_time - output.arrival_time)
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens > self._tokens:
            if self._last is None:
                self._m.ttft.observe(now - self.arrival)
            else:
                self._m.itl.observe(now - self._last)
            self._last = now
            self._tokens = tokens
        if output.finished and not self._done:
            self._done = True
            self._m.e2e.observe(now - self.arrival)
            self._m.prompt_tokens.inc(len(output.prompt_token_ids))
            self._m.cached_tokens.inc(output.num_cached_tokens)
            self._m.generation_tokens.inc(tokens)
            for completion in output.outputs:
                if completion.finish_reason is not None:
                    self._m.record_finish(completion.finish_reason, self._limit_source, self._budget_lost)


class _EngineCollector(Collector):
    """Gauges read at scrape time from the engine's latest stats."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            f"{PREFIX}_truncation_rate",
            "Share of finished choices that stopped on length",
            value=self._metrics.truncation_rate(),
        )
        stats = self._engine.stats()
        if stats is None:
            return
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        gauges = {
            "num_requests_running": ("Requests in the running batch", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled", stats.num_waiting),
            "kv_cache_usage": ("Share of KV-cache blocks in use (0..1)", stats.kv_cache_usage),
            "kv_cache_free_blocks": ("Free KV-cache blocks", stats.num_free_blocks),
            "prefix_cache_hit_rate": ("Prefix-cache hits / queries, in tokens", hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class _StorageCollector(Collector):
    """KV tier and session store counters and bytes, read from the engine at scrape time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._engine.storage_stats()
        if stats is None:
            return
        if stats.tiers is not None:
            yield from _counters(TIER_COUNTERS, stats.tiers)
            yield _tier_bytes(stats)
        if stats.offload is not None:
            yield from _counters(OFFLOAD_COUNTERS, stats.offload)
            yield GaugeMetricFamily(f"{PREFIX}_kv_stream_bytes", "Bytes of running sequences' KV held outside the "
                                    "device pool (host memory or scratch files)", value=stats.offload.offloaded_bytes)
        if stats.sessions is not None:
            yield from _counters(SESSION_COUNTERS, stats.sessions)
            yield GaugeMetricFamily(f"{PREFIX}_session_store_bytes", "Bytes held by the session store (KV chunks "
                                    "and records; 0 until the first session)", value=stats.session_store_bytes)


def _counters(table: dict[str, tuple[str, str]], stats: object) -> Iterator[CounterMetricFamily]:
    for name, (field, doc) in table.items():
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=getattr(stats, field))


def _tier_bytes(stats: StorageStats) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(f"{PREFIX}_kv_tier_bytes", "Bytes of KV chunks held by each tier below the device pool",
                              labels=["tier"])
    gauge.add_metric(["host"], stats.host_tier_bytes)
    gauge.add_metric(["disk"], stats.disk_tier_bytes)
    return gauge


class HTTPMetricsMiddleware:
    """Pure ASGI middleware counting responses by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in TRACKED_PATHS or path.startswith("/v1/models/") else "other"
        endpoint = "/v1/models/{id}" if endpoint.startswith("/v1/models/") else endpoint
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
