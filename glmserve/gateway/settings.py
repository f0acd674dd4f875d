"""The gateway options, the same names on `glmserve serve` and `glmserve gateway`, and the dataclass that
holds them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from glmserve.errors import InvalidRequestError


@dataclass
class GatewaySettings:
    keys_file: str | None = None  # TOML with [[key]] tables; None: no authentication
    redis_url: str | None = None  # shared limit state across gateways; None: in-memory (one process)
    ledger_url: str | None = None  # sqlite:///PATH or postgresql://...; None: the default SQLite file
    prices_file: str | None = None  # price table per model (TOML or JSON)
    request_timeout_s: float | None = 120.0  # None: unbounded (`glmserve serve` unless --request-timeout is given)
    probe_interval_s: float = 30.0
    unhealthy_after: int = 3
    standby_urls: list[str] = field(default_factory=list)
    backend_urls: list[str] = field(default_factory=list)  # `glmserve gateway` only
    replicas: int = 1  # gateways sharing one key's limits (the per-process fallback divides by it)
    default_max_tokens: int = 4096  # completion tokens reserved for a request that sets no max_tokens

    def __post_init__(self) -> None:
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise InvalidRequestError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if not self.probe_interval_s > 0:
            raise InvalidRequestError(f"--probe-interval must be > 0, got {self.probe_interval_s}")
        if self.unhealthy_after < 1 or self.replicas < 1:
            raise InvalidRequestError(f"--unhealthy-after and --gateway-replicas must be >= 1, got "
                                      f"{self.unhealthy_after} and {self.replicas}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        return cls(keys_file=args.keys, redis_url=args.redis, ledger_url=args.ledger, prices_file=args.prices,
                   request_timeout_s=args.request_timeout, probe_interval_s=args.probe_interval,
                   unhealthy_after=args.unhealthy_after, standby_urls=list(args.standby or []),
                   backend_urls=list(getattr(args, "backend", None) or []), replicas=args.gateway_replicas)


def add_gateway_options(parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """The shared options; `serve`: as `glmserve serve` takes them (--request-timeout off unless given; --standby,
    --probe-interval and --unhealthy-after about standbys behind this one server, glmserve/gateway/standby.py)."""
    g = parser.add_argument_group("gateway (keys, limits, billing, timeouts, failover)")
    g.add_argument("--keys", default=None, metavar="FILE", help="API keys (TOML [[key]] tables); reloaded on change")
    g.add_argument("--redis", default=None, metavar="URL", help="Redis for limits shared by several gateways")
    g.add_argument("--ledger", default=None, metavar="sqlite:///PATH|postgresql://...",
                   help="billing ledger (default: SQLite under the glmserve cache directory)")
    g.add_argument("--prices", default=None, metavar="FILE", help="price table per model")
    if serve:
        g.add_argument("--request-timeout", type=float, default=None, metavar="S",
                       help="stop a completion that gets no answer, or whose stream sends nothing, for S seconds: 504 "
                            "or an SSE error event, and the engine request is aborted (default: off, as the prefill "
                            "of a long document on a CPU can take minutes)")
    else:
        g.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                       help="caps the wait for a stream's first byte and bounds a non-streamed answer (504)")
    g.add_argument("--probe-interval", type=float, default=30.0, metavar="S",
                   help="seconds between /v1/health probes of each backend (serve: of each --standby)")
    g.add_argument("--unhealthy-after", type=int, default=3, metavar="N",
                   help="failed probes in a row that mark a backend unhealthy")
    g.add_argument("--standby", action="append", default=None, metavar="URL",
                   help="warmed standby, used once its /v1/health answers 200 and no active backend can serve "
                        "(serve: while this server's model is not ready or its queue is full)")
    g.add_argument("--gateway-replicas", type=int, default=1, metavar="N",
                   help="gateways sharing the limits: with Redis unreachable each enforces 1/N of them, N the larger "
                        "of this and the gateways seen in Redis in the last minute")
