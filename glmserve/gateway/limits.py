"""Per-key limits reserved at admission and settled from the real usage at the end.

Each key has up to five limits, all checked and taken together or not at all:
  requests   token bucket: refills `rps` per second up to `burst` (the seeds' nginx `rate=20r/s burst=20`)
  rpm        token bucket: refills rpm/60 per second up to `rpm`
  tokens     token bucket: refills tpm/60 per second up to `tpm`; admission takes prompt tokens + the effective
             max_tokens, the end gives back what the request did not use (or takes what it used beyond that); a
             request larger than the key's whole tpm is refused as `too_large` (waiting would not help)
  concurrency  requests in flight (each holds a short lease that the gateway renews while the request runs
               (`renew`, every RENEW_EVERY_S), so a killed gateway's slots free within LEASE_S)
  budget     micro-USD per day/month: admission takes the request's highest possible cost, the end settles it to
             the real cost

`RedisLimiter` runs admission and settlement each as one Lua script, which Redis executes atomically with its own
clock (`TIME`), so N gateways sharing one Redis enforce exactly the configured limits (no per-replica drift).
`MemoryLimiter` is the same state machine in one process. When Redis cannot be reached `RedisLimiter` says so
(`backend_state`) and falls back to a `MemoryLimiter` holding each limit divided by the number of gateways, never
to no limit; it tries Redis again after `RETRY_S`. The number of gateways is the larger of `--gateway-replicas` and
the count of gateways seen sharing the Redis: each one marks itself there every HEARTBEAT_S while it admits
requests (a sorted set of instance ids, entries older than GATEWAY_TTL_S dropped), so an operator who starts more
gateways than the flag says still gets a fallback that holds the key's limits in all.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from glmserve.gateway.keys import ApiKey

logger = logging.getLogger(__name__)

RETRY_S = 1.0
NO_LIMIT = -1
LEASE_S = 30.0  # a concurrency slot outlives its gateway by at most this long
RENEW_EVERY_S = 10.0  # how often a gateway renews the leases of its requests in flight
HEARTBEAT_S = 5.0  # how often a gateway marks itself in Redis (on admission; so that gateways count each other)
GATEWAY_TTL_S = 60.0  # a gateway not seen for this long is no longer counted


@dataclass(frozen=True)
class Limits:
    """A key's limits as numbers for the scripts (NO_LIMIT where unset)."""

    rps: float = NO_LIMIT
    burst: int = NO_LIMIT
    rpm: int = NO_LIMIT
    tpm: int = NO_LIMIT
    max_concurrency: int = NO_LIMIT
    budget_micro: int = NO_LIMIT

    @classmethod
    def of(cls, key: ApiKey, divisor: int = 1) -> Limits:
        """The key's limits; with divisor N each is 1/N of it (at least 1, or the smallest rate), never unlimited."""
        def part(value: int | None) -> int:
            return NO_LIMIT if value is None else max(1, value // divisor)

        return cls(
            rps=NO_LIMIT if key.rps is None else key.rps / divisor, burst=part(key.burst), rpm=part(key.rpm),
            tpm=part(key.tpm), max_concurrency=part(key.max_concurrency),
            budget_micro=NO_LIMIT if key.budget_micro is None else key.budget_micro // divisor,
        )

    @property
    def any(self) -> bool:
        return any(v != NO_LIMIT for v in (self.rps, self.rpm, self.tpm, self.max_concurrency, self.budget_micro))


@dataclass(frozen=True)
class Ask:
    """What one request reserves."""

    request_id: str
    tokens: int  # prompt tokens (estimated) + effective max_tokens
    cost_micro: int  # the highest cost those tokens can have
    lease_s: float  # the concurrency slot expires after this long even if the request never settles


@dataclass(frozen=True)
class Decision:
    """The outcome of an admission, with the figures the response headers and a 429 body report."""

    admitted: bool
    limits: Limits
    reason: str | None = None  # too_large | concurrency | requests | requests_per_minute | tokens | budget
    limit: float = 0
    used: float = 0
    requested: float = 0
    wait_s: float = 0.0
    requests_left: float | None = None  # level of the rps bucket, the rpm bucket, the tpm bucket after admission
    rpm_left: float | None = None
    tokens_left: float | None = None
    local: bool = False  # decided by the per-process fallback (Redis unreachable)


@dataclass
class Ticket:
    """An admitted request's reservation, settled once at its end."""

    key: ApiKey
    ask: Ask
    decision: Decision
    period: str
    settled: bool = field(default=False)


class Limiter(Protocol):
    async def admit(self, key: ApiKey, ask: Ask) -> Ticket: ...

    async def settle(self, ticket: Ticket, tokens_used: int, cost_micro: int) -> None: ...

    async def renew(self, tickets: Sequence[Ticket]) -> None:
        """Extends the concurrency lease of each unsettled ticket to its `lease_s` from now."""

    def backend_state(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


def budget_period(period: str, now: float | None = None) -> tuple[str, int]:
    """The UTC period id a budget is counted in ("2026-12-01" or "2026-12") and how long to keep its counter."""
    return _period_at(period, int(time.time() if now is None else now))


@functools.lru_cache(maxsize=8)
def _period_at(period: str, second: int) -> tuple[str, int]:  # once per second, not per request
    t = time.gmtime(second)
    return (time.strftime("%Y-%m-%d", t), 2 * 86400) if period == "day" else (time.strftime("%Y-%m", t), 32 * 86400)


def _level(state: tuple[float, float] | None, now: float, rate: float, cap: float) -> float:
    if state is None:
        return cap
    value, stamp = state
    return min(cap, value + max(0.0, now - stamp) * rate)


class MemoryLimiter:
    """The limits in this process (one gateway, or the fallback of one of N, with `divisor` N)."""

    def __init__(self, divisor: int = 1, clock=time.time) -> None:
        self.divisor = divisor
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (key, which) -> (level, time)
        self._inflight: dict[str, dict[str, float]] = {}  # key -> request id -> lease end
        self._spent: dict[tuple[str, str], int] = {}  # (key, period) -> micro-USD

    async def admit(self, key: ApiKey, ask: Ask) -> Ticket:
        limits = Limits.of(key, self.divisor)
        period, _ = budget_period(key.budget_period)
        with self._lock:
            decision = self._admit(key.name, limits, ask, period, key.tpm)
        return Ticket(key, ask, decision, period)

    def _admit(self, name: str, lim: Limits, ask: Ask, period: str, whole_tpm: int | None) -> Decision:
        now = self._clock()
        b = self._buckets
        r1 = _level(b.get((name, "rps")), now, lim.rps, lim.burst) if lim.rps != NO_LIMIT else None
        r2 = _level(b.get((name, "rpm")), now, lim.rpm / 60, lim.rpm) if lim.rpm != NO_LIMIT else None
        tk = _level(b.get((name, "tpm")), now, lim.tpm / 60, lim.tpm) if lim.tpm != NO_LIMIT else None
        inflight = self._inflight.setdefault(name, {})
        # expired leases matter only at the limit: no scan of every lease per request
        if lim.max_concurrency != NO_LIMIT and len(inflight) >= lim.max_concurrency:
            for rid in [rid for rid, end in inflight.items() if end <= now]:
                del inflight[rid]
        spent = self._spent.get((name, period), 0)
        levels = {"requests_left": r1, "rpm_left": r2, "tokens_left": tk}
        refusal = _refusal(lim, ask, r1, r2, tk, len(inflight), spent, whole_tpm)
        if refusal is not None:
            return Decision(False, lim, *refusal, **levels)
        if r1 is not None:
            b[(name, "rps")] = (r1 - 1, now)
        if r2 is not None:
            b[(name, "rpm")] = (r2 - 1, now)
        if tk is not None:
            b[(name, "tpm")] = (tk - ask.tokens, now)
        if lim.max_concurrency != NO_LIMIT:
            inflight[ask.request_id] = now + ask.lease_s
        if lim.budget_micro != NO_LIMIT:
            self._spent[(name, period)] = spent + ask.cost_micro
        return Decision(True, lim, requests_left=None if r1 is None else r1 - 1,
                        rpm_left=None if r2 is None else r2 - 1, tokens_left=None if tk is None else tk - ask.tokens)

    async def settle(self, ticket: Ticket, tokens_used: int, cost_micro: int) -> None:
        if ticket.settled:
            return
        ticket.settled = True
        lim, name = ticket.decision.limits, ticket.key.name
        with self._lock:
            now = self._clock()
            if lim.tpm != NO_LIMIT:
                level = _level(self._buckets.get((name, "tpm")), now, lim.tpm / 60, lim.tpm)
                self._buckets[(name, "tpm")] = (min(lim.tpm, level + ticket.ask.tokens - tokens_used), now)
            self._inflight.get(name, {}).pop(ticket.ask.request_id, None)
            if lim.budget_micro != NO_LIMIT:
                slot = (name, ticket.period)
                self._spent[slot] = self._spent.get(slot, 0) + cost_micro - ticket.ask.cost_micro

    async def renew(self, tickets: Sequence[Ticket]) -> None:
        with self._lock:
            now = self._clock()
            for ticket in tickets:
                inflight = self._inflight.get(ticket.key.name, {})
                if not ticket.settled and ticket.ask.request_id in inflight:
                    inflight[ticket.ask.request_id] = now + ticket.ask.lease_s

    def spent_micro(self, key: ApiKey) -> int:
        return self._spent.get((key.name, budget_period(key.budget_period)[0]), 0)

    def backend_state(self) -> dict[str, object]:
        return {"backend": "memory", "divisor": self.divisor}

    async def close(self) -> None:
        return None


def _refusal(lim: Limits, ask: Ask, r1: float | None, r2: float | None, tk: float | None, inflight: int,
             spent: int, whole_tpm: int | None) -> tuple[str, float, float, float, float] | None:
    """(reason, limit, used, requested, wait) of the first limit the request does not fit, else None; the same
    order and figures as ADMIT_LUA. `whole_tpm`: the key's tpm undivided (a request larger than 1/N of it is
    refused as `tokens`, to wait until Redis is back; only one larger than all of it is `too_large`)."""
    if tk is not None and whole_tpm is not None and ask.tokens > whole_tpm:
        return ("too_large", whole_tpm, lim.tpm - tk, ask.tokens, math.inf)
    if lim.max_concurrency != NO_LIMIT and inflight + 1 > lim.max_concurrency:
        return ("concurrency", lim.max_concurrency, inflight, 1, 1.0)
    if r1 is not None and r1 < 1:
        return ("requests", lim.burst, lim.burst - r1, 1, (1 - r1) / lim.rps)
    if r2 is not None and r2 < 1:
        return ("requests_per_minute", lim.rpm, lim.rpm - r2, 1, (1 - r2) / (lim.rpm / 60))
    if tk is not None and tk < ask.tokens:
        return ("tokens", lim.tpm, lim.tpm - tk, ask.tokens, (ask.tokens - tk) / (lim.tpm / 60))
    if lim.budget_micro != NO_LIMIT and spent + ask.cost_micro > lim.budget_micro:
        return ("budget", lim.budget_micro, spent, ask.cost_micro, math.inf)
    return None


# KEYS: 1 rps bucket, 2 rpm bucket, 3 tpm bucket, 4 concurrency zset, 5 budget counter
# ARGV: 1 rps, 2 burst, 3 rpm, 4 tpm, 5 max_concurrency, 6 budget, 7 tokens, 8 cost, 9 request id, 10 lease s,
#       11 budget ttl s (-1: no limit). Returns strings (Redis would truncate Lua floats to integers):
#       {admitted, reason, limit, used, requested, wait s, rps level, rpm level, tpm level} (levels '' if unset)
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, rate, cap)
  local h = redis.call('HMGET', key, 'v', 't')
  if not h[1] then return cap end
  return math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
end
local function put(key, v, rate, cap)
  redis.call('HSET', key, 'v', tostring(v), 't', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - v) / rate * 1000) + 60000)
end
local rps, burst, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local conc, budget, tokens, cost = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local r1, r2, tk = nil, nil, nil
if rps >= 0 then r1 = level(KEYS[1], rps, burst) end
if rpm >= 0 then r2 = level(KEYS[2], rpm / 60, rpm) end
if tpm >= 0 then tk = level(KEYS[3], tpm / 60, tpm) end
local inflight = 0
if conc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[4])
end
local spent = 0
if budget >= 0 then spent = tonumber(redis.call('GET', KEYS[5]) or '0') end
local function s(v) if v == nil then return '' end return tostring(v) end
local function no(reason, limit, used, requested, wait)
  return {'0', reason, s(limit), s(used), s(requested), s(wait), s(r1), s(r2), s(tk)}
end
if tk and tokens > tpm then return no('too_large', tpm, tpm - tk, tokens, 'inf') end
if conc >= 0 and inflight + 1 > conc then return no('concurrency', conc, inflight, 1, 1.0) end
if r1 and r1 < 1 then return no('requests', burst, burst - r1, 1, (1 - r1) / rps) end
if r2 and r2 < 1 then return no('requests_per_minute', rpm, rpm - r2, 1, (1 - r2) / (rpm / 60)) end
if tk and tk < tokens then return no('tokens', tpm, tpm - tk, tokens, (tokens - tk) / (tpm / 60)) end
if budget >= 0 and spent + cost > budget then return no('budget', budget, spent, cost, 'inf') end
if r1 then r1 = r1 - 1; put(KEYS[1], r1, rps, burst) end
if r2 then r2 = r2 - 1; put(KEYS[2], r2, rpm / 60, rpm) end
if tk then tk = tk - tokens; put(KEYS[3], tk, tpm / 60, tpm) end
if conc >= 0 then
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[10]), ARGV[9])
  redis.call('PEXPIRE', KEYS[4], math.ceil(tonumber(ARGV[10]) * 1000))
end
if budget >= 0 then
  redis.call('INCRBY', KEYS[5], cost)
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[11]))
end
return {'1', '', '', '', '', '', s(r1), s(r2), s(tk)}
"""

# KEYS: 1 tpm bucket, 2 concurrency zset, 3 budget counter
# ARGV: 1 tpm (-1: none), 2 tokens given back (negative: taken), 3 cost added (negative: given back),
#       4 request id, 5 budget ttl s (-1: no budget)
SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tpm, back, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm >= 0 and back ~= 0 then
  local h = redis.call('HMGET', KEYS[1], 'v', 't')
  local v = tpm
  if h[1] then v = math.min(tpm, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * tpm / 60) end
  v = math.min(tpm, v + back)
  redis.call('HSET', KEYS[1], 'v', tostring(v), 't', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil((tpm - v) / (tpm / 60) * 1000) + 60000)
end
redis.call('ZREM', KEYS[2], ARGV[4])
if tonumber(ARGV[5]) >= 0 and cost ~= 0 then
  redis.call('INCRBY', KEYS[3], cost)
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[5]))
end
return 1
"""


# KEYS: 1 concurrency zset. ARGV: 1 lease s, 2.. request ids. Moves the lease end of the ids still in the set
# (XX: a settled request is not brought back).
RENEW_LUA = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000)) end
return 1
"""


# KEYS: 1 the gateways' sorted set. ARGV: 1 this gateway's id, 2 ttl s. Marks this gateway as seen now, drops the
# ones not seen within ttl, returns how many are left (this one included).
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
return redis.call('ZCARD', KEYS[1])
"""


def _num(text: bytes | str) -> float | None:
    text = text.decode() if isinstance(text, bytes) else text
    return None if text == "" else float(text)


class RedisLimiter:
    """The limits in Redis, shared by every gateway that uses the same Redis and prefix."""

    def __init__(self, url: str, replicas: int = 1, prefix: str = "glmserve:gw:",
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        # a bounded pool: a burst waits for a connection rather than opening one per request (a slow connect under
        # load is no outage); a Redis that is down refuses the connection at once
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=16, timeout=2.0,
                                                        socket_connect_timeout=1.0, socket_timeout=1.0)
        self._redis = aioredis.Redis(connection_pool=pool)
        self._admit = self._redis.register_script(ADMIT_LUA)
        self._settle = self._redis.register_script(SETTLE_LUA)
        self._renew = self._redis.register_script(RENEW_LUA)
        self._heartbeat = self._redis.register_script(HEARTBEAT_LUA)
        self.replicas = max(1, replicas)  # --gateway-replicas
        self.gateways_seen = 1  # gateways marked in Redis at this one's last heartbeat
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.heartbeat_s = heartbeat_s
        self._beat_at = -math.inf
        self.fallback = MemoryLimiter(divisor=self.replicas)
        self.up = True
        self._failed_at = 0.0

    def _keys(self, key: ApiKey, period: str) -> list[str]:
        base = f"{self.prefix}{{{key.name}}}"  # one hash slot per key (Redis Cluster)
        return [f"{base}:rps", f"{base}:rpm", f"{base}:tpm", f"{base}:inflight", f"{base}:budget:{period}"]

    def _down(self, exc: Exception) -> None:
        if self.up:
            logger.error("Redis at %s is unreachable (%s); per-process limits of 1/%d until it is back",
                         self.url, exc, self.fallback.divisor)
        self.up = False
        self._failed_at = time.monotonic()

    def _try_redis(self) -> bool:
        return self.up or time.monotonic() - self._failed_at >= RETRY_S

    async def admit(self, key: ApiKey, ask: Ask) -> Ticket:
        from redis.exceptions import RedisError

        if self._try_redis():
            limits = Limits.of(key)
            period, ttl = budget_period(key.budget_period)
            args = [limits.rps, limits.burst, limits.rpm, limits.tpm, limits.max_concurrency, limits.budget_micro,
                    ask.tokens, ask.cost_micro, ask.request_id, ask.lease_s,
                    ttl if limits.budget_micro != NO_LIMIT else NO_LIMIT]
            try:
                if time.monotonic() - self._beat_at >= self.heartbeat_s:
                    await self._beat()
                out = await self._admit(keys=self._keys(key, period), args=args)
            except (RedisError, OSError) as exc:
                self._down(exc)
            else:
                if not self.up:
                    logger.info("Redis at %s is back; limits are shared again", self.url)
                self.up = True
                admitted, reason, limit, used, requested, wait, r1, r2, tk = out
                decision = Decision(
                    admitted == b"1", limits, reason=reason.decode() or None, limit=_num(limit) or 0,
                    used=_num(used) or 0, requested=_num(requested) or 0, wait_s=_num(wait) or 0.0,
                    requests_left=_num(r1), rpm_left=_num(r2), tokens_left=_num(tk))
                return Ticket(key, ask, decision, period)
        ticket = await self.fallback.admit(key, ask)
        ticket.decision = _as_local(ticket.decision)
        return ticket

    async def _beat(self) -> None:
        self._beat_at = time.monotonic()
        self.gateways_seen = int(await self._heartbeat(keys=[f"{self.prefix}gateways"],
                                                       args=[self.instance, GATEWAY_TTL_S]))
        self.fallback.divisor = max(self.replicas, self.gateways_seen)

    async def settle(self, ticket: Ticket, tokens_used: int, cost_micro: int) -> None:
        from redis.exceptions import RedisError

        if ticket.decision.local:
            await self.fallback.settle(ticket, tokens_used, cost_micro)
            return
        if ticket.settled:
            return
        ticket.settled = True
        lim = ticket.decision.limits
        keys = self._keys(ticket.key, ticket.period)
        args = [lim.tpm, ticket.ask.tokens - tokens_used, cost_micro - ticket.ask.cost_micro, ticket.ask.request_id,
                budget_period(ticket.key.budget_period)[1] if lim.budget_micro != NO_LIMIT else NO_LIMIT]
        try:
            await self._settle(keys=[keys[2], keys[3], keys[4]], args=args)
        except (RedisError, OSError) as exc:  # the reservation stands (the lease frees the slot)
            self._down(exc)

    async def renew(self, tickets: Sequence[Ticket]) -> None:
        from redis.exceptions import RedisError

        await self.fallback.renew([t for t in tickets if t.decision.local])
        by_key: dict[str, tuple[float, list[str]]] = {}  # the key's concurrency set -> (lease s, request ids)
        for t in tickets:
            if not t.decision.local and not t.settled and t.decision.limits.max_concurrency != NO_LIMIT:
                zset = self._keys(t.key, t.period)[3]
                lease, ids = by_key.setdefault(zset, (t.ask.lease_s, []))
                ids.append(t.ask.request_id)
        try:
            for zset, (lease, ids) in by_key.items():
                await self._renew(keys=[zset], args=[lease, *ids])
        except (RedisError, OSError) as exc:  # the leases run out; admission falls back while Redis is away
            self._down(exc)

    def backend_state(self) -> dict[str, object]:
        return {"backend": "redis", "redis": "up" if self.up else "down", "gateways": self.fallback.divisor,
                "fallback": None if self.up else f"per-process limits divided by {self.fallback.divisor}"}

    async def close(self) -> None:
        from redis.exceptions import RedisError

        if self.up:  # a gateway that stops cleanly is no longer counted
            try:
                await self._redis.zrem(f"{self.prefix}gateways", self.instance)
            except (RedisError, OSError):
                pass
        await self._redis.aclose()


def _as_local(decision: Decision) -> Decision:
    return replace(decision, local=True)


def make_limiter(redis_url: str | None, replicas: int) -> Limiter:
    return RedisLimiter(redis_url, replicas) if redis_url else MemoryLimiter(divisor=1)
