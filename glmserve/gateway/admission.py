"""GatewayMiddleware: keys, limits, billing and /v1/usage around any OpenAI-compatible ASGI app.

    app = GatewayMiddleware(inner_app, settings, registry=my_registry, tokenizer=None, parts=None)

Constructor:
  app        the wrapped ASGI app (glmserve's FastAPI server, or the gateway's proxy)
  settings   GatewaySettings: keys_file (None: no authentication, requests billed to the key "anonymous"),
             redis_url (None: in-memory limits), ledger_url (None: SQLite under glmserve.paths.cache_dir()),
             prices_file (None: cost 0), replicas (the per-process fallback holds 1/replicas of each limit),
             default_max_tokens (reserved when a request sets none); concurrency leases are LEASE_S, renewed every
             RENEW_EVERY_S while the request runs (glmserve/gateway/limits.py)
  registry   prometheus CollectorRegistry the host exports at /metrics (glmserve/gateway/metrics.py names);
             None: a new one, at `middleware.registry`
  tokenizer  optional callable text -> token count, for exact prompt sizes at admission (else a chars/4 estimate);
             either way the reservation is reconciled with the real usage at the end
  parts      GatewayParts (keys, limiter, ledger, prices) built beforehand (GatewayParts.build(settings) raises a
             typed error on a bad keys, price or ledger setting, so a host can fail its start); None: built here

What it does per HTTP request:
  /health, /v1/health, /metrics: no key needed; the JSON of /v1/health gets a "gateway" object
  (limit backend, Redis up/down, keys loaded, last keys-file error).
  Any other path needs a key (`Authorization: Bearer KEY`, or `api-key` / `x-api-key`): 401 otherwise. Paths are
  matched as canonical_path() writes them (`/v1//chat/completions/` is billed as `/v1/chat/completions`).
  GET /v1/usage is answered here (the caller's key; an admin key may pass ?key=NAME or ?key=*; ?since=YYYY-MM-DD).
  POST /v1/chat/completions and /v1/completions are admitted against the key's model list (404) and limits (429),
  the wrapped app's response gets x-ratelimit-* headers, and its usage is billed: one ledger row per answered
  request id, written before the usage reaches the client; then the reservation is settled.
  Any other request of a key with request limits (rps, rpm, max_concurrency) counts against them (no tokens, no
  cost; 429 when over) and gets the x-ratelimit-* headers.

What it expects from the wrapped app: OpenAI-compatible responses with `usage` (prompt_tokens, completion_tokens,
`prompt_tokens_details.cached_tokens`) and an `id`. For `"stream": true` the middleware sets
`stream_options.include_usage: true` in the request body it passes on and reads the usage chunk (`choices: []`);
if the client did not ask for usage, that chunk is removed from what the client sees. A response that is not 200,
or a stream that ends without usage (client gone, backend cut), writes no row; the budget reservation is given
back, and the token reservation too when the app answered an error, but not when a 200 ended without usage (so
disconnecting is no way around a TPM limit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve.gateway import fastjson
from glmserve.gateway.asgi_body import read_body, replay_body
from glmserve.gateway.keys import ANONYMOUS_KEY, ApiKey, KeyStore
from glmserve.gateway.ledger import Ledger, LedgerRow, now_ms
from glmserve.gateway.limits import (
    LEASE_S,
    NO_LIMIT,
    RENEW_EVERY_S,
    Ask,
    Limiter,
    Ticket,
    budget_period,
    make_limiter,
)
from glmserve.gateway.metrics import GatewayMetrics
from glmserve.gateway.openai_errors import error_body, ratelimit_headers, retry_headers, send_json
from glmserve.gateway.prices import PriceTable, format_usd
from glmserve.gateway.settings import GatewaySettings
from glmserve.gateway.usage_stream import SSEUsageFilter, Usage, usage_of

logger = logging.getLogger(__name__)

BILLED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
RESPONSES_PATH = "/v1/responses"  # its streams always end with their usage; it takes no stream_options
OPEN_PATHS = frozenset({"/health", "/v1/health", "/metrics"})
HEALTH_PATH = "/v1/health"  # readiness; liveness (/health) stays as the host answers it
USAGE_PATH = "/v1/usage"
CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 8  # role markers and separators a chat template adds per message
TOKENIZE_INLINE_CHARS = 8192  # longer prompts are counted in a worker thread, off the event loop
PARSED_BODY = "glmserve.parsed_body"  # scope key: the JSON object the forwarded body holds (parsed once)


@dataclass
class _Admitted:
    """One admitted request on its way through the wrapped app."""

    key: ApiKey
    model: str
    ticket: Ticket
    streamed: bool
    usage: Usage | None = None
    response_id: str | None = None
    status: int | None = None  # the wrapped app's HTTP status


def _message_text(content: object) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _prompt_text(body: dict) -> tuple[str, int]:
    """The request's prompt text and its number of messages (chat, Responses input items) or prompts
    (completions)."""
    if "messages" in body:
        parts = [_message_text(m.get("content") if isinstance(m, dict) else None) for m in body.get("messages") or []]
        return "\n".join(parts), max(1, len(parts))
    if "input" in body:  # POST /v1/responses: a string, or items (messages, function calls and their outputs)
        items = body["input"] if isinstance(body["input"], list) else [{"content": body["input"]}]
        parts = [_message_text(body.get("instructions"))] if body.get("instructions") else []
        for item in items:
            if isinstance(item, dict):
                parts.append(_message_text(item.get("content", item.get("output", item.get("arguments")))))
        return "\n".join(parts), max(1, len(parts))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        return "\n".join(p if isinstance(p, str) else " " * (CHARS_PER_TOKEN * len(p)) for p in prompt), len(prompt)
    if isinstance(prompt, list):  # one prompt of token ids
        return " " * (CHARS_PER_TOKEN * len(prompt)), 1
    return str(prompt), 1


@dataclass
class GatewayParts:
    """The stateful parts of admission and billing."""

    keys: KeyStore | None  # None: no authentication
    limiter: Limiter
    ledger: Ledger
    prices: PriceTable

    @classmethod
    def build(cls, settings: GatewaySettings) -> GatewayParts:
        return cls(keys=KeyStore(settings.keys_file) if settings.keys_file else None,
                   limiter=make_limiter(settings.redis_url, settings.replicas),
                   ledger=Ledger(settings.ledger_url),
                   prices=PriceTable.load(settings.prices_file) if settings.prices_file else PriceTable.empty())


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, settings: GatewaySettings, *, registry: CollectorRegistry | None = None,
                 tokenizer: Callable[[str], int | None] | None = None, parts: GatewayParts | None = None) -> None:
        self.app = app
        self.settings = settings
        parts = parts or GatewayParts.build(settings)
        self.keys, self.limiter, self.ledger, self.prices = parts.keys, parts.limiter, parts.ledger, parts.prices
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, self.limiter.backend_state)
        self.tokenizer = tokenizer
        self._in_flight: dict[str, Ticket] = {}  # request id -> ticket, whose concurrency lease the heartbeat renews
        self._heartbeat: asyncio.Task | None = None

    # -- entry -------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in OPEN_PATHS:
            if path == HEALTH_PATH:
                await self.app(scope, receive, self._health_send(send))
            else:
                await self.app(scope, receive, send)
            return
        # every other path needs a key, /v1/ or not: a backend may generate on others too (llama-server's
        # /completion and /chat/completions, vLLM's /invocations), which would be free and unlimited otherwise
        key = self._authenticate(scope)
        if key is None:
            await self._unauthorized(scope, send)
            return
        path = canonical_path(path)
        if path == USAGE_PATH and scope["method"] == "GET":
            await self._usage(scope, key, send)
        elif path in BILLED_PATHS and scope["method"] == "POST":
            await self._billed(scope, receive, send, key)
        elif key.rps is None and key.rpm is None and key.max_concurrency is None:
            await self.app(scope, receive, send)
        else:
            await self._counted(scope, receive, send, key)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def on_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                if self._heartbeat is not None:
                    self._heartbeat.cancel()
                await self.limiter.close()
                await asyncio.to_thread(self.ledger.close)
            await send(message)

        await self.app(scope, receive, on_send)

    # -- keys --------------------------------------------------------------------------------------------------
    def _authenticate(self, scope: Scope) -> ApiKey | None:
        if self.keys is None:
            return ANONYMOUS_KEY
        secret = _secret(scope)
        return self.keys.lookup(secret) if secret else None

    async def _unauthorized(self, scope: Scope, send: Send) -> None:
        secret = _secret(scope)
        if not secret:
            self.metrics.auth_failures.labels("missing").inc()
            message = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
                       "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        else:
            self.metrics.auth_failures.labels("unknown").inc()
            shown = f"{secret[:3]}***{secret[-4:]}" if len(secret) > 10 else "***"
            message = f"Incorrect API key provided: {shown}."
        await send_json(send, 401, error_body(message, "invalid_request_error", "invalid_api_key"))

    # -- admission ---------------------------------------------------------------------------------------------
    async def _prompt_tokens(self, body: dict) -> int:
        text, parts = _prompt_text(body)
        if self.tokenizer is not None:
            counted = (self.tokenizer(text) if len(text) < TOKENIZE_INLINE_CHARS
                       else await asyncio.to_thread(self.tokenizer, text))
            if counted is not None:
                return counted + MESSAGE_OVERHEAD_TOKENS * parts * ("messages" in body)
        return estimate_tokens(text) + MESSAGE_OVERHEAD_TOKENS * parts

    def _max_tokens(self, body: dict, key: ApiKey, prompt_tokens: int) -> tuple[int, bool]:
        """Completion tokens to reserve per choice, and whether the client set them."""
        asked = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            return asked, True
        default = self.settings.default_max_tokens
        if key.tpm is not None:  # leave the room the key has rather than refuse for a limit it did not set
            default = max(1, min(default, key.tpm - prompt_tokens))
        return default, False

    async def _billed(self, scope: Scope, receive: Receive, send: Send, key: ApiKey) -> None:
        raw, _ = await read_body(receive)
        try:
            body = fastjson.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deeply: the app refuses it too
            body = None
        if not isinstance(body, dict):  # not JSON: the app answers 400; counted as a request of the raw size
            body = {"prompt": raw.decode(errors="replace")}
            forward = raw
        else:
            forward = None
        model = str(body.get("model") or "")
        if not key.allows_model(model):
            self.metrics.rejections.labels("model").inc()
            await send_json(send, 404, error_body(
                f"The model `{model}` does not exist or you do not have access to it.", "invalid_request_error",
                "model_not_found", "model"))
            return
        prompt_tokens = await self._prompt_tokens(body)
        per_choice, _ = self._max_tokens(body, key, prompt_tokens)
        n = body.get("n") if isinstance(body.get("n"), int) and body.get("n", 1) > 0 else 1
        prompts = _prompt_text(body)[1] if "prompt" in body else 1
        tokens = prompt_tokens + per_choice * n * prompts
        cost = self.prices.cost(model, prompt_tokens, 0, per_choice * n * prompts).cost_micro
        ticket = await self.limiter.admit(key, Ask(f"gw-{os.urandom(16).hex()}", tokens, cost, LEASE_S))
        if not ticket.decision.admitted:
            await self._refuse(send, ticket)
            return
        if ticket.decision.limits.max_concurrency != NO_LIMIT:
            self._hold(ticket)
        self.metrics.admitted.labels(key.name).inc()
        streamed = bool(body.get("stream"))
        client_wants_usage = True
        if streamed and forward is None and scope["path"] != RESPONSES_PATH:
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            client_wants_usage = bool(options.get("include_usage"))
            body["stream_options"] = {**options, "include_usage": True}
        payload = forward if forward is not None else (json.dumps(body).encode() if streamed else raw)
        state = _Admitted(key, model, ticket, streamed)
        inner = _with_length(scope, len(payload))
        if forward is None:
            inner[PARSED_BODY] = body
        try:
            await self.app(inner, replay_body(payload, receive),
                           self._billing_send(send, state, client_wants_usage))
        finally:
            await self._settle(state)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, key: ApiKey) -> None:
        """Any other request of a key with request limits (models, sessions, embeddings, a backend's own routes):
        it counts against the key's requests and concurrency (no tokens, no cost) and gets the x-ratelimit
        headers, so that no path is a way around a key's request rate."""
        ticket = await self.limiter.admit(key, Ask(f"gw-{os.urandom(16).hex()}", 0, 0, LEASE_S))
        if not ticket.decision.admitted:
            await self._refuse(send, ticket)
            return
        if ticket.decision.limits.max_concurrency != NO_LIMIT:
            self._hold(ticket)
        extra = [(k.encode(), v.encode()) for k, v in ratelimit_headers(ticket.decision).items()]

        async def on_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, on_send)
        finally:
            self._in_flight.pop(ticket.ask.request_id, None)
            await self.limiter.settle(ticket, 0, 0)

    async def _refuse(self, send: Send, ticket: Ticket) -> None:
        d, key = ticket.decision, ticket.key
        self.metrics.rejections.labels(d.reason or "unknown").inc()
        headers = ratelimit_headers(d)
        if d.reason == "too_large":  # larger than the key's TPM on its own: retrying cannot help
            message = (f"Request too large for key {key.name} on tokens per min (TPM): Limit {_fmt(d.limit)}, "
                       f"Requested {_fmt(d.requested)}. The input or output tokens must be reduced in order to run "
                       "successfully.")
            await send_json(send, 429, error_body(message, "tokens", "rate_limit_exceeded"),
                            {**headers, "x-should-retry": "false"})
            return
        if d.reason == "budget":
            message = (f"You exceeded your current quota: key {key.name} has a budget of "
                       f"${format_usd(int(d.limit))} per {key.budget_period}, ${format_usd(int(d.used))} used, this "
                       f"request may cost up to ${format_usd(int(d.requested))}.")
            await send_json(send, 429, error_body(message, "insufficient_quota", "insufficient_quota"),
                            {**headers, "x-should-retry": "false"})
            return
        what = {"requests": "requests (burst)", "requests_per_minute": "requests per min (RPM)",
                "tokens": "tokens per min (TPM)", "concurrency": "concurrent requests"}[d.reason or "requests"]
        wait_ms = max(1, math.ceil(d.wait_s * 1000))
        message = (f"Rate limit reached for key {key.name} on {what}: Limit {_fmt(d.limit)}, Used {_fmt(d.used)}, "
                   f"Requested {_fmt(d.requested)}. Please try again in {wait_ms}ms.")
        kind = "tokens" if d.reason == "tokens" else "requests"
        await send_json(send, 429, error_body(message, kind, "rate_limit_exceeded"),
                        {**headers, **retry_headers(d.wait_s)})

    # -- the response ------------------------------------------------------------------------------------------
    def _billing_send(self, send: Send, state: _Admitted, client_wants_usage: bool) -> Send:
        ok = False
        sse: SSEUsageFilter | None = None
        buffered: list[bytes] = []

        async def on_send(message: Message) -> None:
            nonlocal ok, sse
            if message["type"] == "http.response.start":
                state.status = message["status"]
                ok = message["status"] == 200
                headers = list(message.get("headers", []))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ok and content_type.startswith(b"text/event-stream"):
                    sse = SSEUsageFilter(strip_usage_chunk=not client_wants_usage)
                headers += [(k.encode(), v.encode()) for k, v in ratelimit_headers(state.ticket.decision).items()]
                await send({**message, "headers": headers})
                return
            if message["type"] != "http.response.body" or not ok:
                await send(message)
                return
            more = message.get("more_body", False)
            if sse is not None:
                events, usage = sse.feed(message.get("body", b""), final=not more)
                if usage is not None and state.usage is None:
                    state.usage, state.response_id = usage, sse.response_id
                    await self._bill(state)
                if events or not more:
                    await send({"type": "http.response.body", "body": events, "more_body": more})
                return
            buffered.append(message.get("body", b""))
            if more:
                return
            whole = b"".join(buffered)
            state.usage, state.response_id = usage_of(whole)
            if state.usage is not None:
                await self._bill(state)
            await send({"type": "http.response.body", "body": whole, "more_body": False})

        return on_send

    async def _bill(self, state: _Admitted) -> None:
        usage = state.usage
        assert usage is not None
        cost = self.prices.cost(state.model, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        row = LedgerRow(request_id=state.response_id or state.ticket.ask.request_id, ts_ms=now_ms(),
                        key_name=state.key.name, model=state.model, prompt_tokens=usage.prompt_tokens,
                        cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                        price_version=self.prices.version, cost_micro=cost.cost_micro,
                        list_cost_micro=cost.list_micro, streamed=state.streamed)
        try:
            written = await self.ledger.write(row)
        except Exception:  # the client still gets its answer; the failure is logged and counted
            logger.exception("ledger write failed for %s", row.request_id)
            self.metrics.ledger_errors.inc()
            return
        if written:
            self.metrics.ledger_rows.inc()
            name = state.key.name
            self.metrics.tokens.labels(name, "prompt").inc(usage.prompt_tokens)
            self.metrics.tokens.labels(name, "cached").inc(usage.cached_tokens)
            self.metrics.tokens.labels(name, "completion").inc(usage.completion_tokens)
            self.metrics.cost.labels(name).inc(cost.cost_micro)
            self.metrics.list_cost.labels(name).inc(cost.list_micro)

    def _hold(self, ticket: Ticket) -> None:
        """Keeps the ticket's concurrency lease renewed until it settles."""
        self._in_flight[ticket.ask.request_id] = ticket
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.create_task(self._renew_leases())

    async def _renew_leases(self) -> None:
        while self._in_flight:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                await self.limiter.renew(list(self._in_flight.values()))
            except Exception:  # noqa: BLE001 - the next beat tries again; a lost lease only frees a slot early
                logger.exception("renewing concurrency leases failed")

    async def _settle(self, state: _Admitted) -> None:
        ticket = state.ticket
        self._in_flight.pop(ticket.ask.request_id, None)
        if state.usage is None and state.status not in (None, 200):  # the backend refused it: nothing was used
            self.metrics.unbilled.labels("backend_error").inc()
            used_tokens, cost = 0, 0
        elif state.usage is None:  # cut short: the tokens stay taken, nothing is billed
            self.metrics.unbilled.labels("no_usage").inc()
            used_tokens, cost = ticket.ask.tokens, 0
        else:
            used_tokens = state.usage.prompt_tokens + state.usage.completion_tokens
            cost = self.prices.cost(state.model, state.usage.prompt_tokens, state.usage.cached_tokens,
                                    state.usage.completion_tokens).cost_micro
        await self.limiter.settle(ticket, used_tokens, cost)

    # -- /v1/usage and health ----------------------------------------------------------------------------------
    async def _usage(self, scope: Scope, key: ApiKey, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        who = query.get("key", [key.name])[0]
        if who != key.name and not key.admin:
            await send_json(send, 403, error_body("Only an admin key may read another key's usage.",
                                                  "invalid_request_error", "forbidden", "key"))
            return
        since_text = query.get("since", [None])[0]
        try:
            since = (datetime.strptime(since_text, "%Y-%m-%d").replace(tzinfo=timezone.utc) if since_text
                     else _period_start(key))
        except ValueError:
            await send_json(send, 400, error_body("`since` must be a date, YYYY-MM-DD.", "invalid_request_error",
                                                  None, "since"))
            return
        sums = await asyncio.to_thread(self.ledger.summary, int(since.timestamp() * 1000),
                                       None if who == "*" else who)
        data = [_summary_json(s) for s in sums]
        totals = {f: sum(d[f] for d in data) for f in ("requests", "prompt_tokens", "cached_tokens",
                                                        "completion_tokens", "cost_micro_usd", "list_cost_micro_usd",
                                                        "saving_micro_usd")}
        body = {"object": "usage", "key": who, "since": since.date().isoformat(), "data": data, "total": totals}
        if who == key.name and key.budget_micro is not None:
            body["budget"] = {"period": key.budget_period, "limit_micro_usd": key.budget_micro}
        await send_json(send, 200, body)

    def health(self) -> dict[str, object]:
        state = dict(self.limiter.backend_state())
        if self.keys is not None:
            state["keys"] = len(self.keys.keys)
            state["keys_error"] = self.keys.last_error
        return state

    def _health_send(self, send: Send) -> Send:
        parts: list[bytes] = []
        start: Message | None = None

        async def on_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(parts)
            try:
                doc = json.loads(body)
                doc["gateway"] = self.health()
                body = json.dumps(doc).encode()
            except (ValueError, TypeError):
                pass
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return on_send


def estimate_tokens(text: str) -> int:
    """Tokens of `text` without a tokenizer: CHARS_PER_TOKEN characters per token of ASCII (English, code) and one
    per character beyond it (Chinese is 0.6-1.1 tokens per character in GLM's, Qwen's and Llama 3's tokenizers, so
    characters / 4 would reserve a quarter of its tokens against TPM and budget). Non-ASCII characters are counted
    from the UTF-8 length (CJK: 2 bytes more each) rather than by a Python loop over the text."""
    wide = math.ceil((len(text.encode("utf-8", "surrogatepass")) - len(text)) / 2)
    return math.ceil((len(text) - wide) / CHARS_PER_TOKEN) + wide


def canonical_path(path: str) -> str:
    """The path as a lenient backend may route it (slashes merged, dot segments resolved, no trailing slash, lower
    case), so that `/v1//chat/completions/` is billed and limited like `/v1/chat/completions` (the request is
    forwarded as the client sent it; a backend that does not route it answers an error, which is not billed)."""
    return posixpath.normpath("/" + path.lstrip("/")).lower()


def _fmt(value: float) -> str:
    return str(round(value))  # requests and tokens are whole; a bucket refills by fractions in between


def _period_start(key: ApiKey) -> datetime:
    period, _ = budget_period(key.budget_period)
    fmt = "%Y-%m-%d" if key.budget_period == "day" else "%Y-%m"
    return datetime.strptime(period, fmt).replace(tzinfo=timezone.utc)


def _summary_json(s) -> dict:
    return {"key": s.key_name, "model": s.model, "requests": s.requests, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "completion_tokens": s.completion_tokens,
            "cost_micro_usd": s.cost_micro, "list_cost_micro_usd": s.list_cost_micro,
            "saving_micro_usd": s.saving_micro, "cost_usd": format_usd(s.cost_micro)}


def _secret(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        lname = name.lower()
        if lname == b"authorization":
            text = value.decode("latin-1").strip()
            return text[7:].strip() if text[:7].lower() == "bearer " else text
        if lname in (b"api-key", b"x-api-key"):
            return value.decode("latin-1").strip()
    return None


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}

