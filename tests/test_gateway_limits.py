"""Keys, prices and limits of the gateway (glmserve/gateway/): the keys file (hashes, reload, a bad file), the price
table (tiers, integer micro-USD), and the same limit semantics in memory and in a real redis-server (burst, rpm,
tpm reserve and refund, concurrency, budget), with the per-process fallback when Redis is unreachable."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from redis_server import REDIS_BIN, free_port, redis_server

from glmserve.gateway.admission import estimate_tokens
from glmserve.gateway.keys import KeyFileError, KeyStore, load_keys
from glmserve.gateway.limits import Ask, MemoryLimiter, RedisLimiter
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.prices import PriceFileError, PriceTable, format_usd

needs_redis = pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


# -- keys ----------------------------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_keys_are_hashed_and_parsed(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"sk-second").hexdigest()
    path = tmp_path / "keys.toml"
    path.write_text(f'''
[[key]]
name = "a"
key = "sk-first"
rps = 0.5
tpm = 1000
budget_usd = 1.25
budget_period = "day"
models = ["m1"]

[[key]]
name = "b"
key_sha256 = "{digest}"
''')
    a, b = load_keys(path)
    assert a.sha256 == hashlib.sha256(b"sk-first").digest() and b.sha256.hex() == digest
    assert a.rps == 0.5 and a.burst == 1 and a.tpm == 1000 and a.budget_micro == 1_250_000
    assert a.allows_model("m1") and not a.allows_model("m2") and b.allows_model("anything")
    store = KeyStore(path)
    assert store.lookup("sk-first") is not None and store.lookup("sk-first").name == "a"
    assert store.lookup("sk-second").name == "b"
    assert store.lookup("sk-firs") is None and store.lookup("") is None


@pytest.mark.parametrize("entry, message", [
    ('name = "a"', "exactly one of `key` and `key_sha256`"),
    ('name = "a"\nkey = "k"\nrps = -1', "`rps` must be a positive number"),
    ('name = "a"\nkey = "k"\nburst = 3', "`burst` needs `rps`"),
    ('name = "a"\nkey = "k"\nbudget_period = "week"', "`budget_period` must be one of"),
    ('name = "a"\nkey_sha256 = "abc"', "64 hex digits"),
    ('name = "a"\nkey = "k"\nrpm = 1.5', "whole number"),
    ('name = "a"\nkey = "k"\nlimit = 3', "unknown field"),
])
def test_bad_key_entries_are_refused_with_the_reason(tmp_path: Path, entry: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[[key]]\n" + entry + "\n")
    with pytest.raises(KeyFileError, match=message):
        load_keys(path)


def test_revoked_key_is_refused_within_a_second_and_a_bad_file_keeps_the_last_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    _write(path, '[[key]]\nname = "a"\nkey = "sk-a"\n[[key]]\nname = "b"\nkey = "sk-b"\n')
    store = KeyStore(path)
    assert store.lookup("sk-b") is not None
    _write(path, '[[key]]\nname = "a"\nkey = "sk-a"\n')
    revoked_at = time.monotonic()
    while store.lookup("sk-b") is not None:
        assert time.monotonic() - revoked_at < 1.0, "the revoked key was still accepted after 1 s"
        time.sleep(0.01)
    _write(path, '[[key]]\nname = "a"\nkey = "sk-a"\nrps = "fast"\n')  # broken: keeps the keys loaded before
    deadline = time.monotonic() + 1.0
    while store.last_error is None:
        assert time.monotonic() < deadline
        store.lookup("sk-a")
        time.sleep(0.01)
    assert "`rps` must be a positive number" in store.last_error
    assert store.lookup("sk-a") is not None and store.lookup("sk-b") is None


# -- prices --------------------------------------------------------------------------------------------------
PRICES = '''
version = "2026-12-01"
[[model]]
name = "glm-5"
[[model.tier]]
max_prompt_tokens = 32768
input = 1.00
cached_input = 0.20
output = 3.20
[[model.tier]]
input = "2.00"
cached_input = "0.40"
output = "6.40"
'''


def test_prices_tiers_and_integer_rounding(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(PRICES)
    table = PriceTable.load(path)
    assert table.version == "2026-12-01"
    # 1000 prompt (400 cached) + 100 out: 600*1.00 + 400*0.20 + 100*3.20 = 1000 micro-USD... per 1M tokens
    cost = table.cost("glm-5", 1000, 400, 100)
    assert (cost.cost_micro, cost.list_micro, cost.saving_micro) == (1000, 1320, 320)
    long = table.cost("glm-5", 40_000, 0, 0)  # the 32K+ tier prices the whole prompt
    assert long.cost_micro == 80_000
    assert table.cost("glm-5", 1, 0, 0).cost_micro == 1  # 1.0 micro rounds to 1; 0.5 rounds half up
    assert table.cost("other", 1000, 0, 1000).cost_micro == 0  # unpriced model
    assert isinstance(cost.cost_micro, int) and format_usd(1_234_567) == "1.234567" and format_usd(-5) == "-0.000005"


def test_bad_price_files(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(PRICES.replace('version = "2026-12-01"', ""))
    with pytest.raises(PriceFileError, match="version"):
        PriceTable.load(path)
    path.write_text(PRICES.replace("input = 1.00", "input = 0.0000001"))
    with pytest.raises(PriceFileError, match="at most 6 decimals"):
        PriceTable.load(path)
    path.write_text(PRICES.replace("max_prompt_tokens = 32768\n", ""))
    with pytest.raises(PriceFileError, match="every tier but the last"):
        PriceTable.load(path)


# -- limits: the same semantics in memory and in Redis --------------------------------------------------------
_names = iter(range(1_000_000))


def _key(tmp_path: Path, **limits: object):
    name = f"k{next(_names)}"
    path = tmp_path / f"{name}.toml"
    body = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in limits.items())
    path.write_text(f'[[key]]\nname = "{name}"\nkey = "sk-{name}"\n{body}')
    return load_keys(path)[0]


@pytest.fixture(params=["memory", "redis"])
def limiter(request: pytest.FixtureRequest):
    if request.param == "memory":
        yield MemoryLimiter()
        return
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    yield RedisLimiter(request.getfixturevalue("redis_url"))  # one event loop per test: not closed across loops


def _ask(tokens: int = 10, cost: int = 0) -> Ask:
    return Ask(f"r{next(_names)}", tokens, cost, lease_s=600)


def test_burst_admits_exactly_burst_then_reports_the_wait(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, rps=0.01, burst=5)

    async def run():
        return [await limiter.admit(key, _ask()) for _ in range(8)]

    tickets = asyncio.run(run())
    assert [t.decision.admitted for t in tickets] == [True] * 5 + [False] * 3
    refused = tickets[-1].decision
    assert refused.reason == "requests" and refused.limit == 5 and refused.requested == 1
    assert 1 < refused.wait_s <= 100  # a token every 100 s
    assert tickets[4].decision.requests_left == pytest.approx(0, abs=0.01)


def test_tokens_are_reserved_and_refunded_from_real_usage(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, tpm=1000)

    async def run():
        first = await limiter.admit(key, _ask(600))
        refused = await limiter.admit(key, _ask(600))  # 400 left
        await limiter.settle(first, tokens_used=100, cost_micro=0)  # 500 given back
        again = await limiter.admit(key, _ask(600))
        return first, refused, again

    first, refused, again = asyncio.run(run())
    assert first.decision.admitted and first.decision.tokens_left == pytest.approx(400, abs=1)
    assert not refused.decision.admitted and refused.decision.reason == "tokens"
    assert refused.decision.requested == 600 and refused.decision.used == pytest.approx(600, abs=1)
    assert again.decision.admitted and again.decision.tokens_left == pytest.approx(300, abs=1)


def test_a_request_larger_than_the_whole_tpm_is_too_large_and_takes_nothing(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, rps=0.01, burst=5, tpm=1000)

    async def run():
        first = await limiter.admit(key, _ask(300))
        large = await limiter.admit(key, _ask(1001))
        after = await limiter.admit(key, _ask(300))
        return first, large, after

    first, large, after = asyncio.run(run())
    d = large.decision
    assert not d.admitted and d.reason == "too_large" and d.limit == 1000 and d.requested == 1001
    assert d.wait_s == math.inf and d.used == pytest.approx(300, abs=1)
    assert d.tokens_left == pytest.approx(700, abs=1) and d.requests_left == pytest.approx(4, abs=0.01)
    # the refusal took neither a request nor tokens
    assert after.decision.admitted and after.decision.tokens_left == pytest.approx(400, abs=1)
    assert after.decision.requests_left == pytest.approx(3, abs=0.01)


def test_the_fallback_refuses_as_too_large_only_what_the_whole_tpm_cannot_take(tmp_path: Path) -> None:
    key = _key(tmp_path, tpm=900)
    limiter = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0", replicas=3)  # nobody listens: 300 per process

    async def run():
        return await limiter.admit(key, _ask(600)), await limiter.admit(key, _ask(901))

    waits, large = asyncio.run(run())
    assert waits.decision.local and waits.decision.reason == "tokens" and waits.decision.limit == 300
    assert large.decision.reason == "too_large" and large.decision.limit == 900


def test_concurrency_slots_are_freed_at_settle(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, max_concurrency=2)

    async def run():
        a, b = await limiter.admit(key, _ask()), await limiter.admit(key, _ask())
        c = await limiter.admit(key, _ask())
        await limiter.settle(a, 10, 0)
        await limiter.settle(a, 10, 0)  # twice: no second refund
        d = await limiter.admit(key, _ask())
        e = await limiter.admit(key, _ask())
        return a, b, c, d, e

    a, b, c, d, e = asyncio.run(run())
    assert a.decision.admitted and b.decision.admitted and d.decision.admitted
    assert c.decision.reason == "concurrency" and e.decision.reason == "concurrency"


def test_budget_reserves_the_highest_cost_and_settles_to_the_real_one(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, budget_usd="0.001")  # 1000 micro-USD

    async def run():
        a = await limiter.admit(key, _ask(cost=800))
        b = await limiter.admit(key, _ask(cost=300))  # 800 + 300 > 1000
        await limiter.settle(a, 10, cost_micro=100)  # a really cost 100
        c = await limiter.admit(key, _ask(cost=800))  # 100 + 800 fits
        d = await limiter.admit(key, _ask(cost=200))
        return a, b, c, d

    a, b, c, d = asyncio.run(run())
    assert a.decision.admitted and c.decision.admitted
    assert b.decision.reason == "budget" and b.decision.used == 800 and b.decision.limit == 1000
    assert d.decision.reason == "budget" and d.decision.used == 900


def test_unreachable_redis_falls_back_to_divided_limits(tmp_path: Path) -> None:
    key = _key(tmp_path, rps=0.01, burst=20)
    limiter = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0", replicas=3)

    async def run():
        return [await limiter.admit(key, _ask()) for _ in range(10)]

    tickets = asyncio.run(run())
    assert [t.decision.admitted for t in tickets] == [True] * 6 + [False] * 4  # 20 // 3, never unlimited
    assert all(t.decision.local for t in tickets)
    assert limiter.backend_state()["redis"] == "down" and "divided by 3" in limiter.backend_state()["fallback"]


@needs_redis
def test_gateways_count_each_other_in_redis_and_the_fallback_divides_by_that_count(tmp_path: Path) -> None:
    """Three gateways started without --gateway-replicas: once Redis is gone each holds a third of the burst (the
    count they saw in Redis), never the whole burst each; a gateway closed cleanly is no longer counted."""
    key = _key(tmp_path, rps=0.001, burst=30)

    async def run():
        with ExitStack() as stack:
            url = stack.enter_context(redis_server(tmp_path))
            limiters = [RedisLimiter(url, heartbeat_s=0) for _ in range(3)]
            for limiter in limiters * 2:  # the second round: each has seen the other two
                assert (await limiter.admit(key, _ask())).decision.admitted
            seen = [limiter.backend_state()["gateways"] for limiter in limiters]
            spare = RedisLimiter(url, heartbeat_s=0)
            await spare.admit(key, _ask())
            await spare.close()
            await limiters[0].admit(key, _ask())
            after_close = limiters[0].backend_state()["gateways"]
        # Redis is stopped now: each gateway falls back to 1/3 of the burst of 30
        fallback = [await limiters[0].admit(key, _ask()) for _ in range(12)]
        return seen, after_close, fallback, limiters[0].backend_state()

    seen, after_close, fallback, state = asyncio.run(run())
    assert seen == [3, 3, 3] and after_close == 3
    assert [t.decision.admitted for t in fallback] == [True] * 10 + [False] * 2
    assert all(t.decision.local for t in fallback)
    assert state["redis"] == "down" and "divided by 3" in state["fallback"]


@needs_redis
def test_many_limiters_on_one_redis_admit_exactly_the_burst(redis_url: str, tmp_path: Path) -> None:
    """60 concurrent admissions through 3 limiters (own connections) on one key with burst 20: exactly 20."""
    key = _key(tmp_path, rps=0.001, burst=20)

    async def run():
        limiters = [RedisLimiter(redis_url) for _ in range(3)]
        tickets = await asyncio.gather(*(limiters[i % 3].admit(key, _ask()) for i in range(60)))
        for made in limiters:
            await made.close()
        return tickets

    tickets = asyncio.run(run())
    assert sum(t.decision.admitted for t in tickets) == 20
    assert not any(t.decision.local for t in tickets)


def test_the_middleware_says_when_redis_is_down_and_still_limits(tmp_path: Path) -> None:
    """Around the fake backend (in process, over httpx's ASGI transport): with Redis unreachable the gateway still
    answers, enforces 1/N of the burst, and says so in /v1/health and its metrics."""
    import httpx
    from fake_openai import fake_backend
    from prometheus_client import generate_latest

    from glmserve.gateway.admission import GatewayMiddleware
    from glmserve.gateway.settings import GatewaySettings

    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "a"\nkey = "sk-a-0123456789"\nrps = 0.001\nburst = 4\n')
    settings = GatewaySettings(keys_file=str(keys), redis_url=f"redis://127.0.0.1:{free_port()}/0",
                               ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", replicas=2)
    app = GatewayMiddleware(fake_backend, settings)

    async def run() -> tuple[list[int], dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            codes = [(await http.post("/v1/chat/completions", json=body,
                                      headers={"Authorization": "Bearer sk-a-0123456789"})).status_code
                     for _ in range(4)]
            return codes, (await http.get("/v1/health")).json()

    codes, health = asyncio.run(run())
    assert codes == [200, 200, 429, 429]  # burst 4 over 2 gateways: 2 here
    assert health["gateway"]["redis"] == "down" and "divided by 2" in health["gateway"]["fallback"]
    text = generate_latest(app.registry).decode()
    assert 'glmserve_gateway_limit_backend_up{backend="redis"} 0.0' in text
    assert "glmserve_gateway_limit_fallback 1.0" in text


def test_a_renewed_lease_holds_its_slot_and_an_abandoned_one_frees_it(limiter, tmp_path: Path) -> None:
    """A gateway renews the leases of its requests in flight; one killed mid-request stops renewing, and its
    slots come back within the lease (not after minutes)."""
    key = _key(tmp_path, max_concurrency=1)

    async def run():
        held = await limiter.admit(key, Ask(f"r{next(_names)}", 10, 0, lease_s=1.0))
        for _ in range(3):  # 1.5 s in all: past the first lease, kept by renewing
            await asyncio.sleep(0.5)
            await limiter.renew([held])
        while_renewed = await limiter.admit(key, _ask())
        await asyncio.sleep(1.2)  # no renewal: the lease runs out, as when its gateway was SIGKILLed
        after_abandoned = await limiter.admit(key, _ask())
        return held, while_renewed, after_abandoned

    held, while_renewed, after_abandoned = asyncio.run(run())
    assert held.decision.admitted
    assert while_renewed.decision.reason == "concurrency"
    assert after_abandoned.decision.admitted


def test_renewing_a_settled_ticket_does_not_take_its_slot_back(limiter, tmp_path: Path) -> None:
    key = _key(tmp_path, max_concurrency=1)

    async def run():
        done = await limiter.admit(key, _ask())
        await limiter.settle(done, 10, 0)
        await limiter.renew([done])
        return await limiter.admit(key, _ask())

    assert asyncio.run(run()).decision.admitted


def test_the_middleware_renews_the_lease_of_a_long_request(tmp_path: Path, monkeypatch) -> None:
    """A request that runs past its lease keeps its concurrency slot (the heartbeat renews it); the slot is
    free again once the request ends."""
    import httpx

    from glmserve.gateway import admission
    from glmserve.gateway.admission import GatewayMiddleware
    from glmserve.gateway.settings import GatewaySettings

    monkeypatch.setattr(admission, "LEASE_S", 0.6)
    monkeypatch.setattr(admission, "RENEW_EVERY_S", 0.2)

    async def slow_backend(scope, receive, send) -> None:
        await asyncio.sleep(2.0 if scope["path"] == "/v1/completions" else 0)
        body = b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "a"\nkey = "sk-a-0123456789"\nmax_concurrency = 1\n')
    app = GatewayMiddleware(slow_backend, GatewaySettings(keys_file=str(keys),
                                                          ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}"))
    auth = {"Authorization": "Bearer sk-a-0123456789"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def run() -> tuple[int, int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            long = asyncio.create_task(http.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                                           "max_tokens": 2}, headers=auth))
            await asyncio.sleep(1.2)  # twice the lease: without renewing, the slot would be free by now
            during = (await http.post("/v1/chat/completions", json=chat, headers=auth)).status_code
            first = (await long).status_code
            after = (await http.post("/v1/chat/completions", json=chat, headers=auth)).status_code
            return first, during, after

    assert asyncio.run(run()) == (200, 429, 200)


def test_the_example_files_of_the_readme_load() -> None:
    examples = Path(__file__).resolve().parents[1] / "examples" / "gateway"
    keys = {k.name: k for k in load_keys(examples / "keys.toml")}
    assert keys["team-a"].burst == 20 and keys["batch-jobs"].rps == 0.5 and keys["ops"].admin
    assert keys["team-a"].budget_micro == 50_000_000 and keys["batch-jobs"].models == frozenset({"glm-4.5-air"})
    prices = PriceTable.load(examples / "prices.toml")
    long = prices.cost("glm-4.5", 40_000, 10_000, 1_000)  # the 32K+ tier: 30K * 1.20 + 10K * 0.22 + 1K * 4.40
    assert (long.cost_micro, long.list_micro) == (42_600, 52_400)
    models = ModelMap.load(examples / "models.toml")
    assert models.resolve("glm-4.5-air@zhipu").pool == "air" and models.resolve("openai/glm-4.5").canonical == "glm-4.5"


def test_the_prompt_estimate_without_a_tokenizer_counts_chinese_by_character() -> None:
    english = "Prefix caching reuses blocks that hold the same tokens."
    chinese = "长上下文推理需要稀疏注意力和分块缓存。"
    assert estimate_tokens(english) == math.ceil(len(english) / 4)  # unchanged for ASCII
    assert estimate_tokens(chinese) == len(chinese)  # not len / 4: a quarter of what tokenizers make of it
    assert estimate_tokens(english + chinese) == math.ceil(len(english) / 4) + len(chinese)
    assert estimate_tokens("\ud800 lone surrogate") >= 4  # JSON may carry one; no UnicodeEncodeError
