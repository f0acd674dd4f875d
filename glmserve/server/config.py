"""Options of the HTTP server (everything that is not an engine option).

Engine options (model, max_model_len, max_num_seqs, max_waiting_requests, ...) live in
`glmserve.config.EngineConfig`; this dataclass only holds what the HTTP layer needs.

The command line imports this module to parse `glmserve serve`'s options, so it imports no web framework, pydantic
or protocol models (fastapi and our protocol are ~0.5 s of CPU; imported after torch they overlap the model's
load instead of delaying its start: glmserve/server/launch.py). tests/test_startup_imports.py checks it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from glmserve.gateway.settings import GatewaySettings, add_gateway_options
from glmserve.server.reasoning import REASONING_PARSERS
from glmserve.server.tool_parsers import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class RequestLimits:
    """The server's per-request limits; None: no limit beyond the schema's and the context's
    (glmserve/server/limits.py enforces them)."""

    max_body_bytes: int = 8 << 20
    max_messages: int = 2048
    max_prompt_tokens: int | None = None  # the context length limits prompts anyway
    max_n: int = 16
    max_logprobs: int = 20  # OpenAI's top_logprobs maximum
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < (0 if f.name == "max_logprobs" else 1):
                raise ValueError(f"{f.name} must be >= {0 if f.name == 'max_logprobs' else 1}, got {value}")


def flag(name: str) -> str:
    """The `glmserve serve` flag of a RequestLimits field."""
    return "--" + name.replace("_", "-")


@dataclass
class ServerConfig:
    """How the OpenAI-compatible server listens and behaves."""

    host: str = "127.0.0.1"
    port: int = 8000
    # alias id -> canonical served model id; responses echo the id the client asked for
    aliases: dict[str, str] = field(default_factory=dict)
    # seconds a client is told to wait (Retry-After) when the server is overloaded or not ready
    retry_after_s: int = 1
    # on SIGTERM: how long in-flight requests may run before they are aborted
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    # session anchoring (server/anchoring.py): a conversation longer than this many prompt tokens has its
    # earlier turns replaced by a summary; the last `session_summary_keep` messages stay verbatim
    session_summary_threshold: int = 4096
    session_summary_keep: int = 4
    # completion tokens any request may generate (None: the context's room); responses say when it bit
    max_tokens_cap: int | None = None
    # tool-call format (glmserve/server/tool_parsers.py); "auto": the one the chat template implies
    tool_call_parser: str = "auto"
    # reasoning format (glmserve/server/reasoning.py): the output's <think> part as reasoning_content; None: off
    reasoning_parser: str | None = None
    # keys, limits and billing (glmserve/gateway/admission.py) in front of the routes
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    # what one request may cost (glmserve/server/limits.py)
    limits: RequestLimits = field(default_factory=RequestLimits)
    log_format: str = "text"  # or "json" (glmserve/server/logs.py)
    # one JSONL line per finished request in this directory (glmserve/server/interactions.py); None: off
    log_interactions: str | None = None
    log_interactions_max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.session_summary_threshold < 1 or self.session_summary_keep < 1:
            raise ValueError("session_summary_threshold and session_summary_keep must be >= 1")
        if self.log_interactions_max_bytes < 1024:
            raise ValueError(f"log_interactions_max_bytes must be >= 1024, got {self.log_interactions_max_bytes}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be auto or one of {TOOL_CALL_PARSERS}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        for alias, canonical in self.aliases.items():
            if not alias or not canonical:
                raise ValueError(f"alias entries need a non-empty id and target, got {alias!r}={canonical!r}")


def parse_alias(text: str) -> tuple[str, str]:
    """Parse one `ALIAS=CANONICAL` command-line value."""
    alias, sep, canonical = text.partition("=")
    alias, canonical = alias.strip(), canonical.strip()
    if not sep or not alias or not canonical:
        raise ValueError(f"--alias expects ALIAS=CANONICAL, got {text!r}")
    return alias, canonical


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Options of `glmserve serve` that are not engine options."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model id clients use (default: from the checkpoint)")
    g.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="ALIAS=CANONICAL",
        help="accept ALIAS as a model id for the served model CANONICAL (repeatable)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests allowed to wait beyond max-num-seqs; more get 503 + Retry-After",
    )
    g.add_argument("--retry-after", dest="retry_after_s", type=int, default=1, help="Retry-After seconds on 503")
    g.add_argument(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may still run before they are aborted",
    )
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text or as one JSON object each (for log collectors)")
    g.add_argument("--session-summary-threshold", type=int, default=4096,
                   help="prompt tokens above which a session_summary request has its earlier turns summarized")
    g.add_argument("--session-summary-keep", type=int, default=4,
                   help="most recent messages kept verbatim when earlier turns are summarized")
    g.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="completion tokens any request may generate (default: what the context leaves); responses "
                        "report the effective max_tokens and its source in x-glmserve-max-tokens* headers")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_CALL_PARSERS],
                   help="format of the model's tool calls (default: the one its chat template implies, else hermes)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split the model's <think> part into reasoning_content (as vLLM's parsers; default: off)")
    g.add_argument("--log-interactions", default=None, metavar="DIR",
                   help="write each finished request (messages, answer, finish reason, usage) and client feedback "
                        "(POST /v1/feedback) as JSONL in DIR, for `glmserve data feedback` (default: off)")
    g.add_argument("--log-interactions-max-bytes", type=int, default=64 << 20, metavar="N",
                   help="bytes per interaction log file before it rotates (files rotate each UTC day too)")
    add_limit_args(parser)
    add_gateway_options(parser, serve=True)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RequestLimits field (`--max-body-bytes` ...); a refused request names its flag."""
    g = parser.add_argument_group("request limits (over a limit: 400, or 413 for the body)")
    helps = {
        "max_body_bytes": "bytes of one request body",
        "max_messages": "messages of one chat request",
        "max_prompt_tokens": "tokens of one prompt (default: what the context holds)",
        "max_n": "choices (n) of one request",
        "max_logprobs": "logprobs / top_logprobs alternatives per token",
        "max_stop_strings": "stop strings of one request",
        "max_stop_length": "characters of one stop string",
    }
    defaults = RequestLimits()
    for name, text in helps.items():
        g.add_argument(flag(name), dest=name, type=int, default=getattr(defaults, name), metavar="N",
                       help=f"{text} (default: {getattr(defaults, name)})")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        aliases=dict(parse_alias(text) for text in args.alias),
        retry_after_s=args.retry_after_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        log_level=args.log_level,
        session_summary_threshold=args.session_summary_threshold,
        session_summary_keep=args.session_summary_keep,
        max_tokens_cap=args.max_tokens_cap,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        gateway=GatewaySettings.from_args(args),
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)}),
        log_format=args.log_format,
        log_interactions=args.log_interactions,
        log_interactions_max_bytes=args.log_interactions_max_bytes,
    )
