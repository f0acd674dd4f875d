"""Prometheus metrics of admission and billing, registered in the registry the host app exports at /metrics.

Names (the proxy's metrics share the `glmserve_gateway_` prefix; docs/grafana/glmserve-gateway.json shows both):
  glmserve_gateway_auth_failures_total{reason}           401s: missing | unknown key
  glmserve_gateway_rejections_total{reason}              429/403/404 by reason: requests | requests_per_minute |
                                                         tokens | too_large | concurrency | budget | model
  glmserve_gateway_admitted_total{key}                   requests let through
  glmserve_gateway_key_tokens_total{key,kind}            prompt | cached | completion tokens billed
  glmserve_gateway_key_cost_micro_usd_total{key}         billed cost; `..._list_cost_...` without the cache discount
  glmserve_gateway_ledger_rows_total / _ledger_errors_total
  glmserve_gateway_limit_backend_up{backend}             1 while the limit backend (redis | memory) answers
  glmserve_gateway_limit_fallback                        1 while limits are per-process (Redis unreachable)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "glmserve_gateway"


class Children:
    """A labelled metric whose `labels(...)` children are looked up once per label values and kept (prometheus_client
    validates the values and takes a lock on every `labels()` call; on the request path that adds up). For
    label values from a bounded set only: backends, statuses, key names, reasons."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, backend_state: Callable[[], dict[str, object]]) -> None:
        self.auth_failures = Counter(f"{PREFIX}_auth_failures", "Requests refused with 401, by reason", ["reason"],
                                     registry=registry)
        self.rejections = Counter(f"{PREFIX}_rejections", "Requests refused by a key's limits, budget or model "
                                  "list, by reason", ["reason"], registry=registry)
        self.admitted = Children(Counter(f"{PREFIX}_admitted", "Requests admitted, by key", ["key"],
                                         registry=registry))
        self.tokens = Children(Counter(f"{PREFIX}_key_tokens", "Tokens billed, by key and kind (prompt, cached, "
                                       "completion)", ["key", "kind"], registry=registry))
        self.cost = Children(Counter(f"{PREFIX}_key_cost_micro_usd", "Cost billed in micro-USD, by key", ["key"],
                                     registry=registry))
        self.list_cost = Children(Counter(f"{PREFIX}_key_list_cost_micro_usd", "Cost of the same tokens with cached "
                                          "input priced as plain input, in micro-USD, by key", ["key"],
                                          registry=registry))
        self.ledger_rows = Counter(f"{PREFIX}_ledger_rows", "Ledger rows written", registry=registry)
        self.ledger_errors = Counter(f"{PREFIX}_ledger_errors", "Ledger writes that failed", registry=registry)
        self.unbilled = Counter(f"{PREFIX}_unbilled_requests", "Admitted requests that ended without usage "
                                "(client gone or backend cut the stream); their reservation is kept", ["reason"],
                                registry=registry)
        self.live: list[Collector] = [_BackendCollector(backend_state)]  # read at scrape time
        registry.register(self.live[0])


class _BackendCollector(Collector):
    def __init__(self, backend_state: Callable[[], dict[str, object]]) -> None:
        self._state = backend_state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state()
        up = GaugeMetricFamily(f"{PREFIX}_limit_backend_up", "1 while the limit backend answers", labels=["backend"])
        up.add_metric([str(state["backend"])], 0.0 if state.get("redis") == "down" else 1.0)
        yield up
        yield GaugeMetricFamily(f"{PREFIX}_limit_fallback", "1 while limits are per-process (Redis unreachable)",
                                value=1.0 if state.get("redis") == "down" else 0.0)
