"""The gateway options, the same names on `glmserve serve` and `glmserve gateway`, and the dataclass that
holds them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class GatewaySettings:
    keys_file: str | None = None  # TOML with [[key]] tables; None: no authentication
    redis_url: str | None = None  # shared limit state across gateways; None: in-memory (one process)
    ledger_url: str | None = None  # sqlite:///PATH or postgresql://...; None: the default SQLite file
    prices_file: str | None = None  # price table per model (TOML or JSON)
    request_timeout_s: float = 120.0
    probe_interval_s: float = 30.0
    unhealthy_after: int = 3
    standby_urls: list[str] = field(default_factory=list)
    backend_urls: list[str] = field(default_factory=list)  # `glmserve gateway` only
    replicas: int = 1  # gateways sharing one key's limits (the per-process fallback divides by it)
    default_max_tokens: int = 4096  # completion tokens reserved for a request that sets no max_tokens

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        return cls(keys_file=args.keys, redis_url=args.redis, ledger_url=args.ledger, prices_file=args.prices,
                   request_timeout_s=args.request_timeout, probe_interval_s=args.probe_interval,
                   unhealthy_after=args.unhealthy_after, standby_urls=list(args.standby or []),
                   backend_urls=list(getattr(args, "backend", None) or []), replicas=args.gateway_replicas)


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gateway (keys, limits, billing, timeouts, failover)")
    g.add_argument("--keys", default=None, metavar="FILE", help="API keys (TOML [[key]] tables); reloaded on change")
    g.add_argument("--redis", default=None, metavar="URL", help="Redis for limits shared by several gateways")
    g.add_argument("--ledger", default=None, metavar="sqlite:///PATH|postgresql://...",
                   help="billing ledger (default: SQLite under the glmserve cache directory)")
    g.add_argument("--prices", default=None, metavar="FILE", help="price table per model")
    g.add_argument("--request-timeout", type=float, default=120.0, metavar="S")
    g.add_argument("--probe-interval", type=float, default=30.0, metavar="S")
    g.add_argument("--unhealthy-after", type=int, default=3, metavar="N")
    g.add_argument("--standby", action="append", default=None, metavar="URL", help="warmed standby backend")
    g.add_argument("--gateway-replicas", type=int, default=1, metavar="N",
                   help="gateways sharing the limits (without Redis each enforces 1/N of them)")
