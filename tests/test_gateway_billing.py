"""The gateway end to end: real gateway processes (GatewayMiddleware around the fake OpenAI backend of
tests/fake_openai.py, under uvicorn) driven by the official `openai` client and httpx, with a real SQLite ledger
file and a real redis-server: OpenAI's errors and headers, billing streamed and not, random client disconnects,
a 60-request burst through 3 gateways, and a gateway killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fake_openai import expected_usage
from prometheus_client.parser import text_string_to_metric_families
from redis_server import REDIS_BIN, redis_server
from server_process import wait_for

from glmserve.gateway.ledger import Ledger
from glmserve.gateway.prices import PriceTable

FAKE = Path(__file__).with_name("fake_openai.py")
KEYS = '''
[[key]]
name = "open"
key = "sk-open-0123456789"
rpm = 100000
tpm = 10000000

[[key]]
name = "burst"
key = "sk-burst-0123456789"
rps = 0.001
burst = 2

[[key]]
name = "small"
key = "sk-small-0123456789"
tpm = 200

[[key]]
name = "poor"
key = "sk-poor-0123456789"
budget_usd = "0.000030"
budget_period = "day"

[[key]]
name = "narrow"
key = "sk-narrow-0123456789"
models = ["allowed-model"]

[[key]]
name = "boss"
key = "sk-boss-0123456789"
admin = true

[[key]]
name = "shared"
key = "sk-shared-0123456789"
rps = 0.001
burst = 20

[[key]]
name = "counted"
key = "sk-counted-0123456789"
rps = 0.001
burst = 2
'''
PRICES = '''
version = "test-1"
[[model]]
name = "*"
[[model.tier]]
max_prompt_tokens = 100
input = "1.000000"
cached_input = "0.100000"
output = "2.000000"
[[model.tier]]
input = "2.0"
cached_input = "0.2"
output = "4.0"
'''
MESSAGES = [{"role": "user", "content": "Tell me a story about a gateway that counted every token."}]


@dataclass
class Gateway:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    ledger_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, key: str, max_retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=max_retries, timeout=30)

    def rows(self) -> dict[str, tuple]:
        with sqlite3.connect(self.ledger_path) as conn:
            return {r[0]: r for r in conn.execute("SELECT * FROM ledger")}

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@contextmanager
def gateway(workdir: Path, *extra: str, name: str = "gw") -> Iterator[Gateway]:
    keys, prices = workdir / "keys.toml", workdir / "prices.toml"
    keys.write_text(KEYS)
    prices.write_text(PRICES)
    ledger = workdir / "ledger.sqlite3"
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, str(FAKE), "--keys", str(keys), "--prices", str(prices),
                                 "--ledger", f"sqlite:///{ledger}", *extra], stdout=log, stderr=subprocess.STDOUT)
    gw = Gateway(proc, "", log_path, ledger)

    def port() -> int | None:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited with {proc.returncode}:\n{gw.log()[-3000:]}")
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", gw.log())
        return int(match.group(1)) if match else None

    try:
        gw.base_url = f"http://127.0.0.1:{wait_for(port, 60, 'the gateway to listen', gw.log)}"
        yield gw
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("gateway")) as running:
        yield running


def _cost(usage: openai.types.CompletionUsage) -> int:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return PriceTable.load_text(PRICES).cost("m", usage.prompt_tokens, cached, usage.completion_tokens).cost_micro


def test_keys_models_and_limits_answer_as_openai_does(gw: Gateway) -> None:
    before = len(gw.rows())
    missing = httpx.post(f"{gw.base_url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert "You didn't provide an API key" in missing.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided: sk-\\*\\*\\*none"):
        gw.client("sk-wrong-key-none").chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError) as model:
        gw.client("sk-narrow-0123456789").chat.completions.create(model="other-model", messages=MESSAGES)
    assert model.value.code == "model_not_found" and "other-model" in model.value.message
    assert gw.client("sk-narrow-0123456789").chat.completions.create(model="allowed-model", messages=MESSAGES)

    burst = gw.client("sk-burst-0123456789")
    raw = burst.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=3)
    assert raw.headers["x-ratelimit-limit-requests"] == "2" and raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert re.fullmatch(r"\d+m[\d.]+s", raw.headers["x-ratelimit-reset-requests"])
    burst.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    with pytest.raises(openai.RateLimitError) as limited:
        burst.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    err = limited.value
    assert err.code == "rate_limit_exceeded" and err.type == "requests"
    assert re.search(r"Limit 2, Used 2, Requested 1\. Please try again in \d+ms", err.message)
    assert int(err.response.headers["retry-after"]) >= 1 and int(err.response.headers["retry-after-ms"]) > 900_000
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"

    small = gw.client("sk-small-0123456789", max_retries=3)  # x-should-retry: false stops the client's retries
    with pytest.raises(openai.RateLimitError, match=r"Request too large .* Limit 200, Requested \d+") as large:
        small.chat.completions.create(model="m", messages=MESSAGES, max_tokens=500)
    assert large.value.response.headers["x-should-retry"] == "false" and large.value.type == "tokens"
    assert large.value.response.headers["x-ratelimit-limit-tokens"] == "200"  # as on every limited response
    assert large.value.response.headers["x-ratelimit-remaining-tokens"] == "200"  # it took nothing
    assert "retry-after" not in large.value.response.headers
    ok = small.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=20)
    assert ok.headers["x-ratelimit-limit-tokens"] == "200"
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 200
    assert gw.metric("glmserve_gateway_rejections_total", reason="too_large") == 1

    poor = gw.client("sk-poor-0123456789", max_retries=3)
    answered = 0
    with pytest.raises(openai.RateLimitError) as quota:
        for _ in range(50):
            poor.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            answered += 1
    assert quota.value.code == "insufficient_quota" and quota.value.response.headers["x-should-retry"] == "false"
    assert 1 <= answered < 50
    rows = gw.rows()
    # 401, 404, 429 leave no row: narrow 1 + burst 2 + small 1 + poor's answered ones
    assert len(rows) - before == 1 + 2 + 1 + answered
    spent = sum(r[8] for r in rows.values() if r[2] == "poor")
    assert spent <= 30
    assert gw.metric("glmserve_gateway_auth_failures_total", reason="missing") == 1
    assert gw.metric("glmserve_gateway_auth_failures_total", reason="unknown") == 1


def test_every_path_needs_a_key_and_odd_spellings_of_a_billed_path_are_billed(gw: Gateway) -> None:
    """The fake backend generates on any path, as llama-server does on /chat/completions and vLLM on /invocations:
    no path but the open ones reaches it without a key, and a billed path spelled otherwise is billed and limited."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    for path in ("/chat/completions", "/completion", "/invocations", "//v1/chat/completions", "/V1/chat/completions"):
        refused = httpx.post(f"{gw.base_url}{path}", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{gw.base_url}/v1/health").status_code == 200  # the open paths stay open
    assert httpx.get(f"{gw.base_url}/metrics").status_code == 200
    before = gw.rows()
    key = {"Authorization": "Bearer sk-open-0123456789"}
    answered = {}
    for path in ("/v1//chat/completions", "/v1/chat/completions/", "/v1/./chat/completions", "/V1/Chat/Completions"):
        response = httpx.post(f"{gw.base_url}{path}", json=body, headers=key)
        assert response.status_code == 200 and "x-ratelimit-limit-requests" in response.headers, path
        answered[response.json()["id"]] = response.json()["usage"]
    rows = gw.rows()
    assert set(rows) - set(before) == set(answered)
    assert all(rows[rid][6] == usage["completion_tokens"] == 2 for rid, usage in answered.items())
    # a path that is not billed still counts against the key's request rate, with the headers
    counted = {"Authorization": "Bearer sk-counted-0123456789"}
    first = httpx.post(f"{gw.base_url}/v1/embeddings", json={"model": "m", "input": "x"}, headers=counted)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "1"
    assert httpx.post(f"{gw.base_url}/v1/moderations", json={"input": "x"}, headers=counted).status_code == 200
    refused = httpx.post(f"{gw.base_url}/v1/embeddings", json={"model": "m", "input": "x"}, headers=counted)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0" and int(refused.headers["retry-after"]) >= 1
    assert set(gw.rows()) == set(rows)  # none of them billed


def test_stream_and_non_stream_cost_the_same_and_the_ledger_matches_what_clients_saw(gw: Gateway) -> None:
    client = gw.client("sk-open-0123456789")
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7)
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed_usage = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed_usage == whole.usage
    hidden = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7, stream=True))
    assert all(c.usage is None and c.choices for c in hidden)  # the usage chunk the client did not ask for is gone
    rows = gw.rows()
    row_whole, row_stream, row_hidden = rows[whole.id], rows[chunks[0].id], rows[hidden[0].id]
    assert row_whole[8] == row_stream[8] == row_hidden[8] == _cost(whole.usage) > 0
    assert (row_whole[4], row_whole[5], row_whole[6]) == (whole.usage.prompt_tokens,
                                                         whole.usage.prompt_tokens_details.cached_tokens,
                                                         whole.usage.completion_tokens)
    assert row_whole[10] == 0 and row_stream[10] == 1 and row_whole[7] == "test-1"
    assert row_whole[9] > row_whole[8]  # the list cost prices cached input as input

    usage = httpx.get(f"{gw.base_url}/v1/usage", headers={"Authorization": "Bearer sk-open-0123456789"}).json()
    mine = [r for r in rows.values() if r[2] == "open"]
    assert usage["key"] == "open" and usage["total"]["requests"] == len(mine)
    assert usage["total"]["cost_micro_usd"] == sum(r[8] for r in mine)
    assert usage["total"]["saving_micro_usd"] == sum(r[9] - r[8] for r in mine) > 0
    forbidden = httpx.get(f"{gw.base_url}/v1/usage?key=poor", headers={"Authorization": "Bearer sk-open-0123456789"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"
    every = httpx.get(f"{gw.base_url}/v1/usage?key=*&since=2000-01-01",
                      headers={"Authorization": "Bearer sk-boss-0123456789"}).json()
    assert {d["key"] for d in every["data"]} == {r[2] for r in rows.values()}
    assert every["total"]["cost_micro_usd"] == sum(r[8] for r in rows.values())


def test_random_client_disconnects_leave_the_ledger_equal_to_the_usage_clients_saw(gw: Gateway) -> None:
    rng = random.Random(13)

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, dict | None]:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * rng.randrange(10, 400)}],
                "max_tokens": rng.randrange(3, 12), "stream": True, "stream_options": {"include_usage": True}}
        cut = rng.randrange(1, body["max_tokens"]) if i % 3 == 0 else None
        if cut is not None:
            body["cut_after"] = cut
        rid, usage = "", None
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                doc = json.loads(line[6:])
                rid = doc["id"]
                if doc.get("usage"):
                    usage = doc["usage"]
                seen += 1
                if cut is not None and seen == cut:
                    break  # leaves the block: the connection is closed mid-stream
        if cut is None:
            assert usage is not None and usage["completion_tokens"] == body["max_tokens"]
            assert usage["prompt_tokens"] == expected_usage(body).prompt_tokens
        return rid, usage

    async def run() -> list[tuple[str, dict | None]]:
        headers = {"Authorization": "Bearer sk-open-0123456789"}
        async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=30) as http:
            return await asyncio.gather(*(one(http, i) for i in range(24)))

    before = gw.rows()
    results = asyncio.run(run())
    seen = {rid: usage for rid, usage in results if usage is not None}
    cut = {rid for rid, usage in results if usage is None}

    rows = {k: v for k, v in gw.rows().items() if k not in before}  # written before the usage reached the client
    assert set(rows) == set(seen) and not (cut & set(rows)) and len(cut) == 8
    for rid, usage in seen.items():
        assert rows[rid][4:7] == (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                  usage["completion_tokens"])
    assert sum(r[6] for r in rows.values()) == sum(u["completion_tokens"] for u in seen.values())


@pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")
def test_a_burst_through_three_gateways_admits_exactly_the_burst(tmp_path: Path) -> None:
    with ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path))
        gateways = [stack.enter_context(gateway(tmp_path / f"g{i}", "--redis", url, "--gateway-replicas", "3",
                                                name=f"g{i}"))
                    for i in range(3) if (tmp_path / f"g{i}").mkdir() is None]

        async def run() -> list[int]:
            headers = {"Authorization": "Bearer sk-shared-0123456789"}
            clients = [httpx.AsyncClient(base_url=g.base_url, headers=headers, timeout=30) for g in gateways]
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
            try:
                responses = await asyncio.gather(*(clients[i % 3].post("/v1/chat/completions", json=body)
                                                   for i in range(60)))
            finally:
                for c in clients:
                    await c.aclose()
            return [r.status_code for r in responses]

        statuses = asyncio.run(run())
        assert statuses.count(200) == 20 and statuses.count(429) == 40
        health = httpx.get(f"{gateways[0].base_url}/v1/health").json()
        assert health["gateway"]["backend"] == "redis" and health["gateway"]["redis"] == "up"
        assert sum(g.metric("glmserve_gateway_limit_backend_up", backend="redis") for g in gateways) == 3


def test_a_gateway_killed_with_sigkill_leaves_only_whole_rows(tmp_path: Path) -> None:
    with gateway(tmp_path) as gw:
        seen: dict[str, dict] = {}

        async def one(http: httpx.AsyncClient, i: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "y" * (20 + 7 * i)}],
                    "max_tokens": 2 + i % 9, "stream": bool(i % 2), "stream_options": {"include_usage": True}}
            try:
                if not body["stream"]:
                    doc = (await http.post("/v1/chat/completions", json=body)).json()
                    seen[doc["id"]] = doc["usage"]
                    return
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and (doc := json.loads(line[6:])).get("usage"):
                            seen[doc["id"]] = doc["usage"]
            except httpx.HTTPError:
                pass  # the gateway died under this request

        async def run() -> None:
            headers = {"Authorization": "Bearer sk-open-0123456789"}
            async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=30) as http:
                tasks = [asyncio.create_task(one(http, i)) for i in range(200)]
                while len(seen) < 40:
                    await asyncio.sleep(0.005)
                gw.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)

        asyncio.run(run())
        gw.proc.wait(timeout=10)
        assert gw.proc.returncode == -signal.SIGKILL
    rows = Ledger(f"sqlite:///{gw.ledger_path}").rows()
    prices = PriceTable.load_text(PRICES)
    by_id = {r.request_id: r for r in rows}
    assert len(by_id) == len(rows) >= len(seen) >= 40
    for rid, usage in seen.items():  # every usage a client saw is billed, exactly
        r = by_id[rid]
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (
            usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])
    for r in rows:  # and no row is half written: each is whole and priced from its own tokens
        assert r.key_name == "open" and r.model == "m" and r.price_version == "test-1"
        assert r.cost_micro == prices.cost(r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens).cost_micro
