"""`glmserve gateway` in front of replicas, end to end: real gateway processes driven through the official `openai`
client and raw httpx, in front of fast fake OpenAI-compatible backends (tests/fake_backend.py: told to be slow,
stall, cut a stream, fail with 5xx or fail their health check) and of two real `glmserve serve` replicas on a tiny
random-weight model, asked for completions as it has no chat template (prefix affinity that shows in cached tokens,
a replica killed with SIGKILL mid-run).

The fake backends and the replicas are started once per module; each test starts its own gateway (a second)."""

from __future__ import annotations

import json
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, listening_process, wait_for

from glmserve.errors import InvalidRequestError
from glmserve.gateway.breaker import BreakerState, CircuitBreaker
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.retry_budget import RetryBudget

FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
HELLO = [{"role": "user", "content": "hi"}]
FAST = ["--probe-interval", "0.2", "--unhealthy-after", "2"]


@dataclass
class Fake:
    name: str
    process: ServerProcess

    @property
    def url(self) -> str:
        return self.process.base_url

    def control(self, **update: Any) -> dict[str, Any]:
        return httpx.post(f"{self.url}/control", json=update, timeout=10).json()

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/control", timeout=10).json()


@dataclass
class Gateway:
    process: ServerProcess

    @property
    def url(self) -> str:
        return self.process.base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def metric(self, sample: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Fake]]:
    logs = tmp_path_factory.mktemp("fakes")
    with listening_process([sys.executable, str(FAKE_BACKEND), "--name", "a"], logs / "a.log") as a, \
            listening_process([sys.executable, str(FAKE_BACKEND), "--name", "b"], logs / "b.log") as b, \
            listening_process([sys.executable, str(FAKE_BACKEND), "--name", "s"], logs / "s.log") as s:
        yield {"a": Fake("a", a), "b": Fake("b", b), "s": Fake("s", s)}


@pytest.fixture()
def fake(fakes: dict[str, Fake]) -> dict[str, Fake]:
    for f in fakes.values():
        f.control(reset=True)
    return fakes


@contextmanager
def gateway(tmp_path: Path, backends: list[Fake | ServerProcess], *args: str, ready: bool = True) -> Iterator[Gateway]:
    argv = [sys.executable, "-m", "glmserve.cli", "gateway", "--port", "0", *FAST, *args]
    for backend in backends:
        argv += ["--backend", backend.url if isinstance(backend, Fake) else backend.base_url]
    with listening_process(argv, tmp_path / "gateway.log") as process:
        gw = Gateway(process)
        if ready:
            wait_for(lambda: httpx.get(f"{gw.url}/v1/health").status_code == 200, 30, "gateway readiness",
                     process.log)
        yield gw


def served_by(completion: Any) -> str:
    return completion.system_fingerprint


def sse_events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


# ---------------------------------------------------------------------- model-ID adapter, request ids


def test_model_ids_are_mapped_upstream_and_echoed_in_json_and_every_sse_chunk(fake, tmp_path: Path) -> None:
    table = tmp_path / "models.toml"
    table.write_text(f'[pools]\nair = ["{fake["b"].url}"]\n\n[models."openai/glm-4.5"]\nmodel = "glm-4.5"\n\n'
                     '[models."glm-4.5-air@zhipu"]\nmodel = "glm-4.5-air"\npool = "air"\n')
    with gateway(tmp_path, [fake["a"]], "--models", str(table)) as gw:
        client = gw.client()
        assert {m.id for m in client.models.list()} == {"openai/glm-4.5", "glm-4.5-air@zhipu"}
        answer = client.chat.completions.create(model="openai/glm-4.5", messages=HELLO)
        assert answer.model == "openai/glm-4.5" and served_by(answer) == "a"
        chunks = list(client.chat.completions.create(model="glm-4.5-air@zhipu", messages=HELLO, stream=True))
        assert len(chunks) == 5 and {c.model for c in chunks} == {"glm-4.5-air@zhipu"}
        assert {c.system_fingerprint for c in chunks} == {"b"}  # the pool of that id
        passthrough = client.chat.completions.create(model="not-in-the-table", messages=HELLO)
        assert passthrough.model == "not-in-the-table"
        with gw.http() as http:
            response = http.post("/v1/chat/completions", json={"model": "openai/glm-4.5", "messages": HELLO},
                                 headers={"x-request-id": "req-42"})
    assert response.headers["x-request-id"] == "req-42"
    assert fake["a"].state()["models"] == ["glm-4.5", "not-in-the-table", "glm-4.5"]
    assert fake["a"].state()["request_ids"][-1] == "req-42"
    assert fake["b"].state()["models"] == ["glm-4.5-air"]


def test_model_table_errors_are_clear() -> None:
    with pytest.raises(InvalidRequestError, match="pool 'nope', not in"):
        ModelMap.parse({"models": {"x": {"model": "y", "pool": "nope"}}})
    with pytest.raises(InvalidRequestError, match="needs `model"):
        ModelMap.parse({"models": {"x": {"pool": "p"}}, "pools": {"p": ["http://h"]}})
    with pytest.raises(InvalidRequestError, match="non-empty list of http"):
        ModelMap.parse({"models": {"x": "y"}, "pools": {"p": ["ftp://h"]}})


def test_keys_and_billing_wrap_the_proxy(fake, tmp_path: Path) -> None:
    """`glmserve gateway` runs the admission middleware around the proxy: no key, no backend call; an answered
    request leaves one ledger row."""
    keys, ledger = tmp_path / "keys.toml", tmp_path / "ledger.sqlite3"
    keys.write_text('[[key]]\nname = "team"\nkey = "sk-team-0123456789"\n')
    with gateway(tmp_path, [fake["a"]], "--keys", str(keys), "--ledger", f"sqlite:///{ledger}") as gw:
        with pytest.raises(openai.AuthenticationError):
            gw.client().chat.completions.create(model="m", messages=HELLO)
        assert fake["a"].state()["requests"] == 0
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-team-0123456789", max_retries=0, timeout=60)
        assert client.chat.completions.create(model="m", messages=HELLO).usage.total_tokens == 7
        assert gw.metric("glmserve_gateway_auth_failures_total", reason="missing") + \
            gw.metric("glmserve_gateway_auth_failures_total", reason="unknown") == 1
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 1


# ---------------------------------------------------------------------- streams cut, timeouts, disconnects


def test_stream_cut_midway_ends_with_an_error_event_never_done(fake, tmp_path: Path) -> None:
    for f in (fake["a"], fake["b"]):
        f.control(cut_after=1)
    with gateway(tmp_path, [fake["a"], fake["b"]]) as gw:
        with gw.http() as http:
            text = http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "stream": True}).text
        events = sse_events(text)
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "upstream_stream_cut"
        assert json.loads(events[1])["choices"][0]["delta"]["content"].endswith("0 ")  # the part before the cut
        with pytest.raises(openai.APIError, match="lost mid-stream"):
            list(gw.client().chat.completions.create(model="m", messages=HELLO, stream=True))
        assert gw.metric("glmserve_gateway_stream_errors_total", reason="cut") == 2


def test_first_token_timeout_answers_504_and_closes_the_upstream(fake, tmp_path: Path) -> None:
    fake["a"].control(delay_s=60)
    with gateway(tmp_path, [fake["a"]], "--first-token-timeout", "0.5") as gw, gw.http() as http:
        started = time.monotonic()
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "stream": True})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - started < 30
        wait_for(lambda: fake["a"].state()["disconnects"] == 1, 10, "the backend to see the disconnect",
                 gw.process.log)
        assert fake["a"].state()["requests"] == 1  # a timeout is not retried
        assert gw.metric("glmserve_gateway_timeouts_total", kind="first_byte") == 1


def test_request_timeout_of_a_non_streamed_request_closes_the_upstream(fake, tmp_path: Path) -> None:
    fake["a"].control(delay_s=60)
    with gateway(tmp_path, [fake["a"]], "--request-timeout", "0.5") as gw:
        with pytest.raises(openai.APIStatusError) as err:
            gw.client().chat.completions.create(model="m", messages=HELLO)
        assert err.value.status_code == 504
        wait_for(lambda: fake["a"].state()["disconnects"] == 1, 10, "the backend to see the disconnect",
                 gw.process.log)


def test_idle_timeout_between_chunks_ends_with_an_error_event_and_closes_the_upstream(fake, tmp_path: Path) -> None:
    fake["a"].control(stall_after=1)
    with gateway(tmp_path, [fake["a"]], "--idle-timeout", "0.5") as gw, gw.http() as http:
        text = http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, "stream": True}).text
        events = sse_events(text)
        assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == "upstream_idle_timeout"
        wait_for(lambda: fake["a"].state()["disconnects"] == 1, 10, "the backend to see the disconnect",
                 gw.process.log)


def test_client_disconnect_closes_the_upstream(fake, tmp_path: Path) -> None:
    fake["a"].control(chunk_gap_s=30)
    with gateway(tmp_path, [fake["a"]]) as gw:
        with gw.http() as http, http.stream("POST", "/v1/chat/completions",
                                            json={"model": "m", "messages": HELLO, "stream": True}) as response:
            assert next(response.iter_bytes()).startswith(b"data: ")
        wait_for(lambda: fake["a"].state()["disconnects"] == 1, 10, "the backend to see the disconnect",
                 gw.process.log)
        wait_for(lambda: gw.metric("glmserve_gateway_backend_in_flight", backend=fake["a"].url) == 0, 10,
                 "the gateway to release the request", gw.process.log)


def test_client_disconnect_before_a_non_streamed_answer_closes_the_upstream(fake, tmp_path: Path) -> None:
    fake["a"].control(delay_s=30)
    with gateway(tmp_path, [fake["a"]]) as gw:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=gw.url, timeout=0.5) as http:
            http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO})
        wait_for(lambda: fake["a"].state()["disconnects"] == 1, 10, "the backend to see the disconnect",
                 gw.process.log)
        wait_for(lambda: gw.metric("glmserve_gateway_responses_total", status="499") == 1, 10,
                 "the gateway to count the request as abandoned", gw.process.log)
        assert gw.metric("glmserve_gateway_backend_in_flight", backend=fake["a"].url) == 0


# ---------------------------------------------------------------------- failover: retries, breaker, standby


def test_5xx_is_retried_elsewhere_and_the_breaker_opens_then_half_opens(fake, tmp_path: Path) -> None:
    fake["a"].control(status=500)
    with gateway(tmp_path, [fake["a"], fake["b"]], "--eject-after", "2", "--breaker-cooldown", "3") as gw:
        client = gw.client()

        def opened() -> float:
            return gw.metric("glmserve_gateway_breaker_opened_total", backend=fake["a"].url)

        def half_open() -> bool:
            return gw.metric("glmserve_gateway_breaker_state", backend=fake["a"].url) == BreakerState.HALF_OPEN

        for _ in range(60):  # every answer comes from b, whichever backend the router tried first
            assert served_by(client.chat.completions.create(model="m", messages=HELLO)) == "b"
            if opened() == 1:
                break
        assert fake["a"].state()["requests"] == 2  # the breaker opened after two
        assert gw.metric("glmserve_gateway_retries_total", reason="status_500") == 2
        wait_for(half_open, 30, "half-open", gw.process.log)
        while fake["a"].state()["requests"] == 2:  # the trial fails: open again
            assert served_by(client.chat.completions.create(model="m", messages=HELLO)) == "b"
        assert opened() == 2 and fake["a"].state()["requests"] == 3
        fake["a"].control(status=200)
        wait_for(half_open, 30, "half-open", gw.process.log)
        while fake["a"].state()["requests"] == 3:  # a successful trial closes it
            client.chat.completions.create(model="m", messages=HELLO)
        assert gw.metric("glmserve_gateway_breaker_state", backend=fake["a"].url) == BreakerState.CLOSED
        assert opened() == 2


def test_standby_takes_traffic_only_after_its_warm_up_answers(fake, tmp_path: Path) -> None:
    fake["s"].control(health_status=503)  # still warming up
    with gateway(tmp_path, [fake["a"]], "--standby", fake["s"].url) as gw:
        client = gw.client()
        assert served_by(client.chat.completions.create(model="m", messages=HELLO)) == "a"
        fake["a"].control(health_status=503)  # the active one goes down
        wait_for(lambda: httpx.get(f"{gw.url}/v1/health").status_code == 503, 10, "the active backend to be "
                 "marked unhealthy", gw.process.log)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="m", messages=HELLO)
        assert err.value.status_code == 503 and err.value.code == "no_backend_available"
        assert fake["s"].state()["requests"] == 0
        fake["s"].control(health_status=200)  # warm-up done
        wait_for(lambda: httpx.get(f"{gw.url}/v1/health").status_code == 200, 10, "the standby to be healthy",
                 gw.process.log)
        assert served_by(client.chat.completions.create(model="m", messages=HELLO)) == "s"
        assert gw.metric("glmserve_gateway_routed_total", rule="least_loaded", role="standby") == 1
        fake["a"].control(health_status=200)  # the active one is back: the standby steps aside
        wait_for(lambda: gw.metric("glmserve_gateway_backend_healthy", backend=fake["a"].url) == 1, 10,
                 "the active backend to be healthy", gw.process.log)
        assert served_by(client.chat.completions.create(model="m", messages=HELLO)) == "a"


def test_readiness_needs_one_healthy_backend_and_liveness_does_not(fake, tmp_path: Path) -> None:
    fake["a"].control(health_status=503)
    with gateway(tmp_path, [fake["a"]], ready=False) as gw:
        assert httpx.get(f"{gw.url}/health").status_code == 200
        response = httpx.get(f"{gw.url}/v1/health")
        assert response.status_code == 503 and response.json()["backends"][0]["healthy"] is False
        fake["a"].control(health_status=200)
        wait_for(lambda: httpx.get(f"{gw.url}/v1/health").status_code == 200, 10, "readiness", gw.process.log)


# ---------------------------------------------------------------------- routing


def test_sessions_stick_to_one_backend_and_spread_over_both(fake, tmp_path: Path) -> None:
    with gateway(tmp_path, [fake["a"], fake["b"]]) as gw:
        client = gw.client()
        homes = {}
        for n in range(16):
            session = f"session-{n}"
            seen = {served_by(client.chat.completions.create(model="m", messages=HELLO,
                                                             extra_headers={"x-session-id": session}))
                    for _ in range(3)}
            seen |= {served_by(client.chat.completions.create(model="m", messages=HELLO,
                                                              extra_body={"session_id": session}))}
            assert len(seen) == 1, (session, seen)
            homes[session] = seen.pop()
        assert set(homes.values()) == {"a", "b"}
        assert gw.metric("glmserve_gateway_routed_total", rule="session", role="active") == 64


def test_prefix_affinity_keeps_a_prefix_on_one_backend_unless_it_is_overloaded(fake, tmp_path: Path) -> None:
    system = {"role": "system", "content": "You are a careful assistant for the accounting team. " * 8}
    with gateway(tmp_path, [fake["a"], fake["b"]]) as gw:
        client = gw.client()
        homes = {served_by(client.chat.completions.create(model="m", messages=[system, {"role": "user",
                                                                                        "content": f"q{n}"}]))
                 for n in range(8)}
        assert len(homes) == 1
        home = fake[homes.pop()]
        assert gw.metric("glmserve_gateway_routed_total", rule="prefix", role="active") == 8
        home.control(delay_s=1.5)  # requests pile up on it: bounded load sends the surplus to the other one
        with ThreadPoolExecutor(6) as pool:
            served = list(pool.map(lambda n: served_by(client.chat.completions.create(
                model="m", messages=[system, {"role": "user", "content": f"r{n}"}])), range(6)))
        assert set(served) == {"a", "b"}


def test_retry_budget_caps_retries_at_a_share_of_traffic() -> None:
    now = [0.0]
    budget = RetryBudget(0.1, window_s=10, floor=2, clock=lambda: now[0])
    for _ in range(50):
        budget.on_request()
    assert sum(budget.try_retry() for _ in range(20)) == 2 + 5
    now[0] = 11  # the window moved on
    assert sum(budget.try_retry() for _ in range(20)) == 2


def test_breaker_counts_only_failures_close_in_time() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=3, window_s=2, cooldown_s=5, clock=lambda: now[0])
    for t in (0, 3, 6):  # three failures, each more than 2 s after the last: no ejection
        now[0] = t
        breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED
    for t in (7, 8):
        now[0] = t
        breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.can_pass()
    now[0] = 13
    assert breaker.can_pass()
    breaker.acquire()
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.can_pass()  # one trial at a time
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED


# ---------------------------------------------------------------------- real glmserve replicas


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("replicas")
    args = ["--model", str(tiny_model_dir("llama")), "--served-model-name", "tiny", "--max-model-len", "512",
            "--num-threads", "1", "--kv-cache-memory-bytes", str(32 << 20), "--session-store", "off",
            "--shutdown-timeout", "5"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GLMSERVE_TORCH_ONLY", "1")  # no C++ kernel to build or load: the gateway is under test here
        with glmserve_process(args, logs / "r0.log") as r0, glmserve_process(args, logs / "r1.log") as r1:
            env.undo()
            for r in (r0, r1):
                wait_for(lambda r=r: httpx.get(f"{r.base_url}/v1/health").status_code == 200, STARTUP_TIMEOUT_S,
                         "replica readiness", r.log)
            yield [r0, r1]


def test_prefix_affinity_shows_in_cached_tokens_on_real_replicas(replicas, tmp_path: Path) -> None:
    document = "Paged attention keeps key and value blocks in one pool. " * 12
    with gateway(tmp_path, replicas) as gw:
        client = gw.client()
        for n in range(4):
            answer = client.completions.create(model="tiny", max_tokens=2, prompt=f"{document} question {n}")
            cached = answer.usage.prompt_tokens_details.cached_tokens
            assert (cached == 0) if n == 0 else (cached >= 0.8 * answer.usage.prompt_tokens), (n, answer.usage)


def test_sigkill_of_a_replica_mid_run_fails_no_non_streamed_request(replicas, tmp_path: Path) -> None:
    """Four clients send non-streamed requests and two send streams while one replica is killed with SIGKILL;
    every non-streamed request succeeds (retried on the survivor) and every stream ends with [DONE] or an error
    event. Runs last: it kills a replica of the module's fixture."""
    victim = replicas[0]
    failures: list[str] = []
    stream_ends: list[str] = []
    answered = [0]
    stop = threading.Event()
    with gateway(tmp_path, replicas) as gw:
        client = gw.client()

        def unary(n: int) -> None:
            while not stop.is_set():
                try:
                    client.completions.create(model="tiny", max_tokens=24, prompt=f"client {n} says {answered[0]}")
                    answered[0] += 1
                except openai.APIError as exc:
                    failures.append(repr(exc))

        def stream(n: int) -> None:
            with gw.http() as http:
                while not stop.is_set():
                    body = {"model": "tiny", "max_tokens": 48, "stream": True, "ignore_eos": True,
                            "prompt": f"stream {n}"}
                    events = sse_events(http.post("/v1/completions", json=body).text)
                    stream_ends.append("done" if events[-1] == "[DONE]" else json.loads(events[-1])["error"]["code"])

        threads = [threading.Thread(target=unary, args=(n,)) for n in range(4)]
        threads += [threading.Thread(target=stream, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: answered[0] >= 8, 120, "traffic", gw.process.log)
        victim.proc.send_signal(signal.SIGKILL)
        killed_at = answered[0]
        wait_for(lambda: answered[0] >= killed_at + 16, 120, "traffic after the kill", gw.process.log)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert failures == []
        assert set(stream_ends) <= {"done", "upstream_stream_cut"}
        assert gw.metric("glmserve_gateway_backend_healthy", backend=victim.base_url) == 0 or \
            gw.metric("glmserve_gateway_breaker_state", backend=victim.base_url) != BreakerState.CLOSED
