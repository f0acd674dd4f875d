"""The pool of backends: active probes of `/v1/health` (unhealthy after N consecutive failures, healthy again on a
200), the load each reports in `/metrics`, the gateway's own in-flight count, a circuit breaker each (passive
ejection), and standbys that take traffic only while no active backend can, and only once their warm-up answered
(glmserve's `/v1/health` is 200 only after a warm-up generation)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from glmserve.gateway.breaker import BreakerState, CircuitBreaker

logger = logging.getLogger(__name__)

# gauges that count a backend's queued + running requests (glmserve; vLLM and SGLang spell them so)
LOAD_METRICS = (b"glmserve_num_requests_running", b"glmserve_num_requests_waiting", b"vllm:num_requests_running",
                b"vllm:num_requests_waiting", b"sglang:num_running_reqs", b"sglang:num_queue_reqs")


@dataclass(eq=False)
class Backend:
    url: str
    breaker: CircuitBreaker
    standby: bool = False
    healthy: bool = False  # the active probes' verdict (unknown = unhealthy until the first probe answers)
    probe_failures: int = 0
    in_flight: int = 0  # requests this gateway has open on it
    reported_load: float = 0.0  # running + waiting requests from its /metrics (all its clients)
    has_metrics: bool = True  # False once /metrics answered 404: not scraped again
    last_error: str | None = None

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.reported_load)

    def available(self) -> bool:
        return self.healthy and self.breaker.can_pass()


def parse_load(text: bytes) -> float | None:
    """Sum of the queue/running gauges in a Prometheus text page (None when it has none of them)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(LOAD_METRICS):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(None, 1)[1])
                seen = True
    return total if seen else None


@dataclass
class BackendPool:
    client: httpx.AsyncClient
    probe_interval_s: float
    unhealthy_after: int
    eject_after: int
    cooldown_s: float
    backends: dict[str, Backend] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def add(self, url: str, standby: bool = False) -> Backend:
        url = url.rstrip("/")
        if url not in self.backends:
            self.backends[url] = Backend(url, CircuitBreaker(self.eject_after, 2.0, self.cooldown_s), standby)
        return self.backends[url]

    def group(self, urls: Iterable[str]) -> tuple[Backend, ...]:
        return tuple(self.add(url) for url in urls)

    @property
    def standbys(self) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends.values() if b.standby)

    def candidates(self, group: Sequence[Backend]) -> tuple[Backend, ...]:
        """The backends a request for `group` may go to now: its available actives, else warmed standbys."""
        ready = tuple(b for b in group if b.available())
        return ready or tuple(b for b in self.standbys if b.available())

    def ready(self) -> bool:
        return any(b.healthy for b in self.backends.values())

    async def probe(self, backend: Backend) -> None:
        timeout = min(5.0, max(1.0, self.probe_interval_s))
        try:
            response = await self.client.get(f"{backend.url}/v1/health", timeout=timeout)
            ok = response.status_code == 200
            backend.last_error = None if ok else f"/v1/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, backend.last_error = False, f"{type(exc).__name__}: {exc}"
        if ok:
            if not backend.healthy:
                logger.info("backend %s is healthy", backend.url)
            backend.healthy, backend.probe_failures = True, 0
            await self._scrape_load(backend, timeout)
            return
        backend.probe_failures += 1
        if backend.healthy and backend.probe_failures >= self.unhealthy_after:
            logger.warning("backend %s is unhealthy after %d failed probes (%s)", backend.url,
                           backend.probe_failures, backend.last_error)
            backend.healthy = False

    async def _scrape_load(self, backend: Backend, timeout: float) -> None:
        if not backend.has_metrics:
            return
        try:
            response = await self.client.get(f"{backend.url}/metrics", timeout=timeout)
        except httpx.HTTPError:
            return
        if response.status_code == 404:
            backend.has_metrics = False
        elif response.status_code == 200:
            load = parse_load(response.content)
            backend.has_metrics = load is not None
            backend.reported_load = load or 0.0

    async def start(self) -> None:
        """Probes every backend once (so that readiness is known at once), then keeps probing each."""
        await asyncio.gather(*(self.probe(b) for b in self.backends.values()))
        self._tasks = [asyncio.create_task(self._probe_loop(b)) for b in self.backends.values()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _probe_loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe(backend)

    def describe(self) -> list[dict]:
        return [{"url": b.url, "role": "standby" if b.standby else "active", "healthy": b.healthy,
                 "breaker": BreakerState(b.breaker.state).name.lower(), "in_flight": b.in_flight,
                 "reported_load": b.reported_load, "last_error": b.last_error} for b in self.backends.values()]
