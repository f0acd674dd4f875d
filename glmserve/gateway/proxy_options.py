"""Options of `glmserve gateway` alone (the backends, the model-ID table, timeouts, ejection, routing); the options
it shares with `glmserve serve` are in settings.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from glmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ProxyOptions:
    models_file: str | None = None  # model-ID table (TOML or JSON); None: ids pass through unchanged
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 30.0  # before a stream's first byte (non-streamed: request_timeout) ...
    first_token_s_per_1k: float = 2.0  # ... plus this per 1,000 prompt tokens (estimated), capped by request_timeout
    idle_timeout_s: float = 30.0  # the longest gap between two chunks of a stream
    max_retries: int = 2
    retry_budget: float = 0.1  # retries as a share of requests (over the last 60 s)
    eject_after: int = 3  # consecutive connect errors / 5xx (each within 2 s of the last) that open the breaker
    breaker_cooldown_s: float = 5.0  # open -> half-open
    prefix_chars: int = 256  # prefix affinity hashes this many leading characters of the rendered prompt
    load_factor: float = 1.25  # bounded-load consistent hashing: no backend above this times the mean load
    backend_keys: tuple[str, ...] = ()  # URL=ENVVAR: the API key a backend needs (backends.backend_keys)

    def __post_init__(self) -> None:
        positive = {"--connect-timeout": self.connect_timeout_s, "--first-token-timeout": self.first_token_timeout_s,
                    "--idle-timeout": self.idle_timeout_s, "--breaker-cooldown": self.breaker_cooldown_s,
                    "--prefix-chars": self.prefix_chars, "--eject-after": self.eject_after}
        for name, value in positive.items():
            if value <= 0:
                raise InvalidRequestError(f"{name} must be > 0, got {value}")
        if self.max_retries < 0 or not 0 <= self.retry_budget <= 1 or self.first_token_s_per_1k < 0:
            raise InvalidRequestError("--max-retries must be >= 0, --retry-budget in [0, 1], "
                                      "--first-token-timeout-per-1k >= 0")
        if self.load_factor <= 1:
            raise InvalidRequestError(f"--load-factor must be > 1, got {self.load_factor}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProxyOptions:
        return cls(models_file=args.models, connect_timeout_s=args.connect_timeout,
                   first_token_timeout_s=args.first_token_timeout, first_token_s_per_1k=args.first_token_timeout_per_1k,
                   idle_timeout_s=args.idle_timeout, max_retries=args.max_retries, retry_budget=args.retry_budget,
                   eject_after=args.eject_after, breaker_cooldown_s=args.breaker_cooldown,
                   prefix_chars=args.prefix_chars, load_factor=args.load_factor,
                   backend_keys=tuple(args.backend_key or ()))


def add_proxy_options(parser: argparse.ArgumentParser) -> None:
    d = ProxyOptions()
    g = parser.add_argument_group("backends, routing and failover")
    g.add_argument("--backend", action="append", default=None, metavar="URL",
                   help="an OpenAI-compatible backend (repeat for several replicas)")
    g.add_argument("--backend-key", action="append", default=None, metavar="URL=ENVVAR",
                   help="the backend at URL needs the API key in environment variable ENVVAR (sent as Bearer; the "
                        "client's own key is never forwarded)")
    g.add_argument("--models", default=None, metavar="FILE",
                   help="model-ID table (TOML/JSON): external ids -> canonical model and backend pool")
    g.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S")
    g.add_argument("--first-token-timeout", type=float, default=d.first_token_timeout_s, metavar="S",
                   help="wait for the first streamed byte of a short prompt (a non-streamed answer: --request-timeout)")
    g.add_argument("--first-token-timeout-per-1k", type=float, default=d.first_token_s_per_1k, metavar="S",
                   help="added per 1,000 prompt tokens; the sum is capped by --request-timeout")
    g.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, metavar="S",
                   help="longest gap between two stream chunks")
    g.add_argument("--max-retries", type=int, default=d.max_retries, metavar="N")
    g.add_argument("--retry-budget", type=float, default=d.retry_budget, metavar="SHARE",
                   help="retries allowed as a share of the requests of the last 60 s (plus 10)")
    g.add_argument("--eject-after", type=int, default=d.eject_after, metavar="N",
                   help="consecutive connect errors or 5xx (within 2 s of each other) that open a backend's breaker")
    g.add_argument("--breaker-cooldown", type=float, default=d.breaker_cooldown_s, metavar="S",
                   help="seconds an open breaker waits before a trial request")
    g.add_argument("--prefix-chars", type=int, default=d.prefix_chars, metavar="N",
                   help="leading prompt characters hashed for prefix affinity")
    g.add_argument("--load-factor", type=float, default=d.load_factor, metavar="C",
                   help="bounded-load hashing: a backend above C times the mean load is skipped")
