"""The pool of backends: active probes of `/v1/health` (unhealthy after N consecutive failures, healthy again on a
200; a backend that answers 404 there, such as a provider's OpenAI-compatible endpoint, is probed on `/v1/models`
instead), the load each reports in `/metrics`, the gateway's own in-flight count, a circuit breaker each (passive
ejection), and standbys that take traffic only while no active backend can, and only once their warm-up answered
(glmserve's `/v1/health` is 200 only after a warm-up generation).

Per-backend keys: `--backend-key URL=ENVVAR` gives the backend at URL the API key in environment variable ENVVAR
(read once at start; the secret is never on the command line). It goes upstream as `Authorization: Bearer KEY`
on requests and probes; the client's own credentials never go upstream (proxy.py drops them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from glmserve.errors import InvalidRequestError
from glmserve.gateway.breaker import BreakerState, CircuitBreaker

logger = logging.getLogger(__name__)

# gauges that count a backend's queued + running requests (glmserve; vLLM and SGLang spell them so)
LOAD_METRICS = (b"glmserve_num_requests_running", b"glmserve_num_requests_waiting", b"vllm:num_requests_running",
                b"vllm:num_requests_waiting", b"sglang:num_running_reqs", b"sglang:num_queue_reqs")
HEALTH_PATH, FALLBACK_HEALTH_PATH = "/v1/health", "/v1/models"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    api_key: str | None = None  # sent upstream as `Authorization: Bearer` (--backend-key)
    health_path: str = HEALTH_PATH  # FALLBACK_HEALTH_PATH once HEALTH_PATH answered 404

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.reported_load)

    def available(self) -> bool:
        return self.healthy and self.breaker.can_pass()

    def upstream_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` (the client's credentials already removed) with this backend's own key, if it has one."""
        return headers if self.api_key is None else {**headers, "authorization": f"Bearer {self.api_key}"}



def backend_keys(specs: Iterable[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """`URL=ENVVAR` specs (--backend-key) -> {URL: the variable's value}; a typed error for a malformed spec, a
    URL given twice, or a variable that is unset or empty."""
    environ = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    for spec in specs:
        url, sep, name = spec.rpartition("=")
        url = url.rstrip("/")
        if not sep or not url.startswith(("http://", "https://")) or not _ENV_NAME.fullmatch(name):
            raise InvalidRequestError(f"--backend-key {spec!r}: expected URL=ENVVAR, e.g. "
                                      "https://api.example.com=EXAMPLE_API_KEY")
        if url in keys:
            raise InvalidRequestError(f"--backend-key: {url} is given twice")
        if not environ.get(name):
            raise InvalidRequestError(f"--backend-key {url}: environment variable {name} is not set (or empty)")
        keys[url] = environ[name]
    return keys


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
    keys: dict[str, str] = field(default_factory=dict)  # backend URL -> its API key (backend_keys)
    backends: dict[str, Backend] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def add(self, url: str, standby: bool = False) -> Backend:
        url = url.rstrip("/")
        if url not in self.backends:
            self.backends[url] = Backend(url, CircuitBreaker(self.eject_after, 2.0, self.cooldown_s), standby,
                                         api_key=self.keys.get(url))
        return self.backends[url]

    def check_keys(self) -> None:
        """Refuses a --backend-key whose URL names no backend (a typo would send the backend no key)."""
        unknown = sorted(set(self.keys) - set(self.backends))
        if unknown:
            raise InvalidRequestError(f"--backend-key names no backend (--backend, --standby or a pool): {unknown}")

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
            response = await self._get(backend, backend.health_path, timeout)
            if response.status_code == 404 and backend.health_path == HEALTH_PATH:
                backend.health_path = FALLBACK_HEALTH_PATH  # not glmserve: any OpenAI-compatible server lists models
                response = await self._get(backend, backend.health_path, timeout)
            ok = response.status_code == 200
            backend.last_error = None if ok else f"{backend.health_path} answered {response.status_code}"
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
            response = await self._get(backend, "/metrics", timeout)
        except httpx.HTTPError:
            return
        if response.status_code == 404:
            backend.has_metrics = False
        elif response.status_code == 200:
            load = parse_load(response.content)
            backend.has_metrics = load is not None
            backend.reported_load = load or 0.0

    async def _get(self, backend: Backend, path: str, timeout: float) -> httpx.Response:
        return await self.client.get(backend.url + path, timeout=timeout, headers=backend.upstream_headers({}))

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
