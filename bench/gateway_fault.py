"""The load-and-fault run of `bench_gateway.py fault`, and its checks.

Parts, all real: a redis-server (the gateways' shared limits and the replicas' session store), two `glmserve
serve` replicas on a tiny random-weight llama with `--session-store redis://...`, and two `glmserve gateway`
processes in front of both, with admission on (a keys file of 4 keys with limits, `--redis`, one SQLite ledger
file both write, a price table). 32 clients: 16 non-streamed and 8 streamed completions, some of which the
client abandons at random (a non-streamed request cancelled after a random delay, a stream closed after its
first chunk), and 8 session clients (non-streamed multi-turn conversations with `X-Session-Id`). Each client
sends its requests to the two gateways in turn, and to the other one when a gateway refuses the connection
(down: nothing was sent). Replica 0 is killed with SIGKILL at --kill-at and restarted --restart-after seconds
later; gateway 1 is killed with SIGKILL at --gateway-kill-at and restarted --gateway-restart-after later.

The checks, each printed as PASS/FAIL (the run exits 1 when one fails):
- non_streamed: no non-streamed request failed (a request in flight on gateway 1 when it was killed is "lost
  to the gateway kill", counted apart; one the client abandoned is "disconnected").
- streams: every stream ended with `[DONE]` or an SSE error event, never by just stopping (streams lost to
  the gateway kill or closed by their client apart).
- ledger: the ledger (the SQLite file, read after the run) equals the usage the clients saw: for every answer
  whose usage a client received, exactly one row with the same key, prompt, cached and completion tokens and
  the cost the price table gives them; per key, the sums of those rows equal the clients' sums. Rows for
  answers no client received are allowed only for requests the clients lost (disconnected, or in flight on
  the killed gateway), at most one per lost request of that key: the gateway writes a row before the usage
  leaves it, so an answer it finished but could not deliver is billed, and nothing a client received is
  unbilled.
- gateway_kill: gateway 1 died of SIGKILL mid-run with requests in flight, the ledger file passes SQLite's
  integrity check afterwards, and the ledger check above holds for the answers received through it before
  the kill and after its restart.
- sessions: session turns after the first, sent while replica 0 was down (so served by the survivor),
  report `prompt_tokens_details.cached_tokens` > 0; among them the turns of sessions whose ring owner is
  replica 0 (their KV was on the dead replica), and the survivor's session-store restores went up in that
  window (the KV came from Redis, not its own prefix cache). Later turns outside that window that report
  no cached tokens are listed (`uncached_turns`), not failed: a turn that moves to the other replica right
  after the previous one (bounded-load diversion, replica 0 rejoining) can read Redis before the previous
  turn's asynchronous save landed there (glmserve/kv/session_io.py waits for that write only on the replica
  that wrote it).

Fault times are seconds since the clients started, kept however late the loaded event loop runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_gateway import Proc, free_port, gateway_proc, running

from glmserve.gateway.backends import Backend
from glmserve.gateway.breaker import CircuitBreaker
from glmserve.gateway.ledger import Ledger
from glmserve.gateway.prices import PriceTable
from glmserve.gateway.router import HashRing, key_hash

TESTS = Path(__file__).resolve().parent.parent / "tests"
N_CLIENTS = 32
KEYS = [(f"team-{i}", f"sk-bench-team-{i}-0123456789") for i in range(4)]
KEY_LIMITS = "rps = 200\nburst = 400\nrpm = 100000\ntpm = 100000000\nmax_concurrency = 64\n"
PRICES = '''version = "bench-1"
[[model]]
name = "*"
[[model.tier]]
max_prompt_tokens = 256
input = "100"
cached_input = "10"
output = "400"
[[model.tier]]
input = "200"
cached_input = "20"
output = "800"
'''
TURNS = 5  # turns per session conversation
WORDS = ("gateway replica ledger token session cache stream budget probe breaker router prefix window "
         "limit usage model answer prompt").split()


@dataclass
class Outcome:
    """One request as its client saw it."""

    client: int
    key: str
    kind: str  # unary | stream | session
    gateway: int
    started: float  # seconds since the clients started
    ended: float
    result: str  # ok | failed | done | error_event | silent_cut | http_error | disconnected | lost_gateway
    response_id: str | None = None
    usage: dict | None = None  # the usage the client received
    detail: str = ""
    session: str | None = None
    turn: int = 0


@dataclass
class Run:
    args: argparse.Namespace
    gateways: list[Proc]
    t0: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # seconds since t0: replica_killed, replica_ready, ...
    restores: dict[str, float] = field(default_factory=dict)  # the survivor's session restores, before / after
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def lost_to_gateway_kill(self, gateway: int, started: float) -> bool:
        killed = self.events.get("gateway_killed")
        return gateway == 1 and killed is not None and started <= killed + 0.5

    # -- one request -------------------------------------------------------------------------------------------
    async def unary(self, http: httpx.AsyncClient, o: Outcome, body: dict, headers: dict, abandon_after: float | None
                    ) -> None:
        try:
            call = http.post("/v1/completions", json=body, headers=headers)
            r = await (asyncio.wait_for(call, abandon_after) if abandon_after is not None else call)
        except TimeoutError:
            o.result = "disconnected"
            return
        if r.status_code != 200:
            o.result, o.detail = "failed", f"{r.status_code} {r.text[:200]}"
            return
        doc = r.json()
        o.result, o.response_id, o.usage = "ok", doc["id"], doc["usage"]
        o.detail = doc["choices"][0]["text"]

    async def stream(self, http: httpx.AsyncClient, o: Outcome, body: dict, headers: dict, abandon: bool) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        last = None
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                o.result, o.detail = "http_error", f"{r.status_code} {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                if last == "[DONE]":
                    continue
                doc = json.loads(last)
                o.response_id = doc.get("id", o.response_id)
                if doc.get("usage"):
                    o.usage = doc["usage"]
                if abandon and doc.get("choices"):
                    o.result = "disconnected"
                    return  # leaving the block closes the connection mid-stream
        if last == "[DONE]":
            o.result = "done"
        elif last is not None and '"error"' in last:
            o.result, o.detail = "error_event", last[:200]
        else:
            o.result, o.detail = "silent_cut", repr(last)[:200]

    async def send(self, clients: list[httpx.AsyncClient], o: Outcome, body: dict, headers: dict,
                   rng: random.Random, first: int) -> None:
        abandon = o.kind != "session" and rng.random() < self.args.disconnect_share
        for g in (first, 1 - first):
            o.gateway, o.started = g, self.now()
            try:
                if o.kind == "stream":
                    await self.stream(clients[g], o, body, headers, abandon)
                else:
                    await self.unary(clients[g], o, body, headers, rng.uniform(0.05, 1.5) if abandon else None)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout):
                o.result, o.detail = "failed", f"gateway {g} refused the connection"
                continue  # that gateway is down; nothing was sent
            except httpx.HTTPError as exc:
                lost = self.lost_to_gateway_kill(g, o.started)
                o.result = "lost_gateway" if lost else ("silent_cut" if o.kind == "stream" else "failed")
                o.detail = f"{type(exc).__name__}: {exc}"
                break
        o.ended = self.now()
        self.outcomes.append(o)

    # -- clients -----------------------------------------------------------------------------------------------
    def http_clients(self, n: int) -> list[httpx.AsyncClient]:
        """Client n's connections to each gateway (made before the clock starts: each costs an SSL context)."""
        headers = {"Authorization": f"Bearer {KEYS[n % len(KEYS)][1]}"}
        return [httpx.AsyncClient(base_url=g.url, headers=headers, timeout=300) for g in self.gateways]

    async def client(self, n: int, clients: list[httpx.AsyncClient]) -> None:
        kind = "stream" if n % 4 == 3 else ("session" if n % 4 == 1 else "unary")
        name = KEYS[n % len(KEYS)][0]
        rng = random.Random(n)
        conversation, turn, prompt, i = 0, TURNS, "", 0
        try:
            while not self.stop.is_set():
                i += 1
                o = Outcome(n, name, kind, 0, 0.0, 0.0, "failed")
                extra: dict[str, str] = {}
                if kind == "session":
                    if turn >= TURNS:
                        conversation, turn = conversation + 1, 0
                        prompt = f"Conversation {n}.{conversation} opens: " + " ".join(rng.choices(WORDS, k=24))
                    o.session, o.turn = f"c{n}-{conversation}", turn + 1
                    extra = {"X-Session-Id": o.session}
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
                else:
                    body = {"model": "tiny", "prompt": f"client {n} request {i}: " + " ".join(rng.choices(WORDS, k=8)),
                            "max_tokens": 32, "ignore_eos": True}
                await self.send(clients, o, body, extra, rng, i % 2)
                if kind == "session" and o.result == "ok":
                    turn += 1
                    prompt += o.detail + f" Turn {turn + 1}: " + " ".join(rng.choices(WORDS, k=8))
        finally:
            for c in clients:
                await c.aclose()


def _metric(url: str, *names: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(None, 1)[1]) for line in text.splitlines() if line.startswith(names))


RESTORES = ("glmserve_session_restores",)


async def _faults(run: Run, replicas: list[Proc], gateways: list[Proc]) -> None:
    args = run.args

    async def until(second: float) -> None:  # a time since t0, however late the loop runs this task
        await asyncio.sleep(max(0.0, second - run.now()))

    async def replica_fault() -> None:
        # the survivor's restores before the kill (a scrape can take seconds on a loaded machine: not waited for)
        await until(args.kill_at - 2)
        before = asyncio.ensure_future(asyncio.to_thread(_metric, replicas[1].url, *RESTORES))
        await until(args.kill_at)
        replicas[0].stop(signal.SIGKILL)
        run.events["replica_killed"] = run.now()
        run.restores["before"] = await before
        await until(args.kill_at + args.restart_after)
        await asyncio.to_thread(replicas[0].start, "/v1/health", 900)
        run.events["replica_ready"] = run.now()
        run.restores["after"] = await asyncio.to_thread(_metric, replicas[1].url, *RESTORES)

    async def gateway_fault() -> None:
        if args.gateway_kill_at <= 0:
            return
        await until(args.gateway_kill_at)
        gateways[1].proc.send_signal(signal.SIGKILL)
        run.events["gateway_killed"] = run.now()
        await asyncio.to_thread(gateways[1].proc.wait, 30)
        run.events["gateway_exit_code"] = gateways[1].proc.returncode
        await until(args.gateway_kill_at + args.gateway_restart_after)
        await asyncio.to_thread(gateways[1].start)
        run.events["gateway_ready"] = run.now()

    await asyncio.gather(replica_fault(), gateway_fault())


async def _drive(run: Run, replicas: list[Proc], gateways: list[Proc], loads: list[float]) -> None:
    http = [run.http_clients(n) for n in range(N_CLIENTS)]
    run.t0 = time.monotonic()
    faults = asyncio.ensure_future(_faults(run, replicas, gateways))
    clients = [asyncio.ensure_future(run.client(n, http[n])) for n in range(N_CLIENTS)]

    async def sample_load() -> None:
        while not run.stop.is_set():
            loads.append(os.getloadavg()[0])
            await asyncio.sleep(30)

    sampler = asyncio.ensure_future(sample_load())
    await asyncio.sleep(max(0.0, run.args.seconds - run.now()))
    run.stop.set()
    await asyncio.gather(*clients)
    run.events["clients_stopped"] = run.now()
    await faults  # a replica restart slower than the run is waited for (the session window needs its end)
    await sampler


# ---------------------------------------------------------------------- checks


def _tokens(usage: dict) -> tuple[int, int, int]:
    details = usage.get("prompt_tokens_details") or {}
    return usage["prompt_tokens"], int(details.get("cached_tokens") or 0), usage["completion_tokens"]


def check_ledger(outcomes: list[Outcome], ledger_path: Path) -> tuple[bool, dict]:
    prices = PriceTable.load_text(PRICES)
    rows = {r.request_id: r for r in Ledger(f"sqlite:///{ledger_path}").rows()}
    seen = {o.response_id: o for o in outcomes if o.usage is not None}
    wrong = []
    client_sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    ledger_sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for rid, o in seen.items():
        tokens = _tokens(o.usage)
        cost = prices.cost("tiny", *tokens).cost_micro
        for sums, values in ((client_sums[o.key], (1, *tokens, cost)),):
            for j, v in enumerate(values):
                sums[j] += v
        row = rows.get(rid)
        if row is None or (row.key_name, row.prompt_tokens, row.cached_tokens, row.completion_tokens,
                           row.cost_micro) != (o.key, *tokens, cost):
            wrong.append(f"{rid}: client saw {o.key} {tokens} ${cost} micro, ledger {row}")
            continue
        for j, v in enumerate((1, row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.cost_micro)):
            ledger_sums[row.key_name][j] += v
    unseen = [r for rid, r in rows.items() if rid not in seen]
    lost = Counter(o.key for o in outcomes if o.result in ("disconnected", "lost_gateway"))
    unseen_by_key = Counter(r.key_name for r in unseen)
    over = {k: (n, lost[k]) for k, n in unseen_by_key.items() if n > lost[k]}
    ok = not wrong and not over and dict(client_sums) == dict(ledger_sums)
    fields = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micro_usd")
    return ok, {
        "per_key_clients_saw": {k: dict(zip(fields, v)) for k, v in sorted(client_sums.items())},
        "per_key_ledger_rows_of_those": {k: dict(zip(fields, v)) for k, v in sorted(ledger_sums.items())},
        "rows_no_client_received": dict(unseen_by_key), "requests_lost_by_clients": dict(lost),
        "unseen_rows_over_lost": over, "mismatches": wrong[:5], "rows": len(rows)}


def check_sessions(run: Run, replicas: list[Proc]) -> tuple[bool, dict]:
    killed, ready = run.events.get("replica_killed"), run.events.get("replica_ready")
    ring = HashRing([Backend(r.url, CircuitBreaker()) for r in replicas])
    turns = [o for o in run.outcomes if o.kind == "session" and o.result == "ok" and o.turn >= 2]
    window = [o for o in turns if killed is not None and ready is not None and killed < o.started and o.ended < ready]
    orphaned = [o for o in window if ring.walk(key_hash("s:" + o.session))[0].url == replicas[0].url]
    restores = run.restores.get("after", 0) - run.restores.get("before", 0)
    cached = [o for o in window if _tokens(o.usage)[1] > 0]
    orphaned_cached = [o for o in orphaned if _tokens(o.usage)[1] > 0]
    ok = bool(window) and len(cached) == len(window) and bool(orphaned) and restores > 0
    uncached = [f"{o.session} turn {o.turn} gw{o.gateway} t={o.started:.1f}-{o.ended:.1f}" for o in turns
                if _tokens(o.usage)[1] == 0]
    return ok, {"turns_after_the_first": len(turns), "uncached_turns": uncached[:10],
                "of_those_with_cached_tokens": sum(_tokens(o.usage)[1] > 0 for o in turns),
                "turns_while_replica_0_down": len(window), "of_those_with_cached_tokens_in_window": len(cached),
                "turns_of_sessions_owned_by_replica_0": len(orphaned),
                "of_those_with_cached_tokens_owned": len(orphaned_cached),
                "mean_cached_tokens_in_window": round(sum(_tokens(o.usage)[1] for o in window)
                                                      / max(1, len(window)), 1),
                "survivor_session_restores_in_window": restores}


def verdicts(run: Run, replicas: list[Proc], ledger_path: Path) -> tuple[dict, dict]:
    counts = Counter(f"{o.kind}:{o.result}" for o in run.outcomes)
    failed_unary = [o for o in run.outcomes if o.kind != "stream" and o.result == "failed"]
    silent = [o for o in run.outcomes if o.kind == "stream" and o.result == "silent_cut"]
    refused_streams = [o for o in run.outcomes if o.kind == "stream" and o.result == "http_error"]
    ledger_ok, ledger = check_ledger(run.outcomes, ledger_path)
    with sqlite3.connect(ledger_path) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    lost = counts["unary:lost_gateway"] + counts["session:lost_gateway"] + counts["stream:lost_gateway"]
    killed = run.events.get("gateway_exit_code") == -signal.SIGKILL
    sessions_ok, sessions = check_sessions(run, replicas)
    checks = {
        "non_streamed": (not failed_unary, f"{len(failed_unary)} failed non-streamed requests"),
        "streams": (not silent, f"{counts['stream:error_event']} cut streams ended with an error event, "
                                f"{len(silent)} stopped without one; {len(refused_streams)} answered an HTTP error "
                                "before their first byte"),
        "ledger": (ledger_ok, f"{ledger['rows']} rows, {len(ledger['mismatches'])} mismatches shown; rows of answers "
                              f"no client received {ledger['rows_no_client_received']}, requests the clients lost "
                              f"{ledger['requests_lost_by_clients']}"),
        "gateway_kill": ((killed and integrity == "ok" and ledger_ok,
                          f"gateway 1 exit {run.events.get('gateway_exit_code')}, {lost} requests lost in flight, "
                          f"ledger integrity_check {integrity}") if run.args.gateway_kill_at > 0
                         else (integrity == "ok", "no gateway killed (--gateway-kill-at 0)")),
        "sessions": (sessions_ok, f"{sessions['of_those_with_cached_tokens_in_window']} of "
                                  f"{sessions['turns_while_replica_0_down']} turns while replica 0 was down report "
                                  f"cached tokens ({sessions['of_those_with_cached_tokens_owned']} of "
                                  f"{sessions['turns_of_sessions_owned_by_replica_0']} of its sessions); survivor "
                                  f"restores from Redis: {sessions['survivor_session_restores_in_window']:g}"),
    }
    details = {"outcomes": dict(sorted(counts.items())), "ledger": ledger, "sessions": sessions,
               "first_failures": [f"{o.kind} gw{o.gateway} t={o.started:.1f}-{o.ended:.1f}: {o.detail}"
                                  for o in failed_unary + silent + refused_streams][:8]}
    return checks, details


# ---------------------------------------------------------------------- the run


def run_fault(args: argparse.Namespace) -> tuple[dict, bool]:
    sys.path.insert(0, str(TESTS))
    from redis_server import redis_server
    from tiny_models import make_tiny_model

    logdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-gateway-fault-"))
    logdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model("llama", logdir / "tiny")
    keys, prices, ledger = logdir / "keys.toml", logdir / "prices.toml", logdir / "ledger.sqlite3"
    keys.write_text("".join(f'[[key]]\nname = "{n}"\nkey = "{s}"\n{KEY_LIMITS}\n' for n, s in KEYS))
    prices.write_text(PRICES)
    with redis_server(logdir) as redis_url:
        replicas = []
        for i in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "glmserve.cli", "serve", "--port", str(port), "--model", str(model),
                    "--served-model-name", "tiny", "--max-model-len", "1024", "--num-threads", "1",
                    "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "32",
                    "--session-store", redis_url, "--session-ttl", "3600"]
            replicas.append(Proc(argv, logdir / f"replica{i}.log", port, env={"GLMSERVE_TORCH_ONLY": "1"}))
        admission = ["--keys", str(keys), "--redis", redis_url, "--ledger", f"sqlite:///{ledger}", "--prices",
                     str(prices), "--gateway-replicas", "2", "--probe-interval", "1", "--unhealthy-after", "3"]
        gateways = [gateway_proc([r.url for r in replicas], logdir, *admission) for _ in range(2)]
        for i, g in enumerate(gateways):
            g.log = logdir / f"gateway{i}.log"
        run, loads = Run(args, gateways), []
        with running(*replicas, *gateways):
            asyncio.run(_drive(run, replicas, gateways, loads))
            retries = sum(_metric(g.url, "glmserve_gateway_retries_total") for g in gateways)
            refused = sum(_metric(g.url, "glmserve_gateway_retries_refused_total") for g in gateways)
    checks, details = verdicts(run, replicas, ledger)
    result = {"clients": N_CLIENTS, "seconds": args.seconds, "logs": str(logdir),
              "events_s": {k: round(v, 1) for k, v in run.events.items()},
              "load_average_1m": {"min": min(loads), "max": max(loads), "mean": round(sum(loads) / len(loads), 2)},
              "retries": retries, "retries_refused": refused,
              "checks": {k: {"pass": ok, "what": what} for k, (ok, what) in checks.items()}, **details}
    print(json.dumps(result, indent=1))
    for name, (ok, what) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}: {what}")
    return result, all(ok for ok, _ in checks.values())


def add_fault_args(f: argparse.ArgumentParser) -> None:
    f.add_argument("--seconds", type=float, default=600, help="length of the client traffic")
    f.add_argument("--kill-at", type=float, default=120, help="replica 0 is killed with SIGKILL at this second")
    f.add_argument("--restart-after", type=float, default=30, help="... and restarted this much later")
    f.add_argument("--gateway-kill-at", type=float, default=420,
                   help="gateway 1 is killed with SIGKILL at this second (0: never)")
    f.add_argument("--gateway-restart-after", type=float, default=5)
    f.add_argument("--workdir", default=None, help="logs, the model, the ledger (default: a new temp dir)")
    f.add_argument("--disconnect-share", type=float, default=0.05,
                   help="share of non-session requests the client abandons (cancelled / closed after a chunk)")
