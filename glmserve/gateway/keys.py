"""API keys from a TOML file of `[[key]]` tables, kept as SHA-256 hashes and compared in constant time.

    [[key]]
    name = "team-a"             # what the ledger, /v1/usage and the metrics call it
    key = "sk-..."              # or key_sha256 = "<64 hex digits>" (the file then holds no secret)
    rps = 0.5                   # token bucket: rps refill per second, `burst` capacity (default: ceil(rps))
    burst = 20
    rpm = 600                   # requests per minute
    tpm = 100000                # tokens per minute (prompt + effective max_tokens at admission)
    max_concurrency = 8
    budget_usd = "50"           # spend per budget_period ("day" or "month", UTC); a string or a number
    budget_period = "month"
    models = ["glm-5"]          # model ids the key may ask for (default: every model)
    admin = false               # may read every key's usage (GET /v1/usage?key=NAME|*)

`KeyStore` re-reads the file when its mtime, size or inode changes (polled at most every 0.2 s on lookup, so a
revoked key is refused within 1 s); a file that fails to parse keeps the last good keys and logs why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import tomllib

from glmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
PERIODS = ("day", "month")
ANONYMOUS = "anonymous"  # the ledger's key name when the gateway runs without --keys


class KeyFileError(InvalidRequestError):
    """The keys file cannot be read or holds an invalid entry; the message says which and why."""


@dataclass(frozen=True)
class ApiKey:
    """One key's identity and limits; a limit of None is no limit."""

    name: str
    sha256: bytes
    rps: float | None = None
    burst: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget_micro: int | None = None  # micro-USD per period
    budget_period: str = "month"
    models: frozenset[str] | None = None
    admin: bool = False

    def allows_model(self, model: str | None) -> bool:
        return self.models is None or (model is not None and model in self.models)


ANONYMOUS_KEY = ApiKey(name=ANONYMOUS, sha256=b"")


def hash_key(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _positive(entry: dict, field: str, kind: type, where: str) -> float | int | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)) or value <= 0:
        raise KeyFileError(f"{where}: `{field}` must be a positive number, got {value!r}")
    if kind is int and value != int(value):
        raise KeyFileError(f"{where}: `{field}` must be a whole number, got {value!r}")
    return kind(value)


def _budget_micro(entry: dict, where: str) -> int | None:
    value = entry.get("budget_usd")
    if value is None:
        return None
    try:
        usd = Decimal(str(value))  # TOML floats are parsed as Decimal (see load_keys): no binary rounding
    except InvalidOperation:
        raise KeyFileError(f"{where}: `budget_usd` must be a number, got {value!r}") from None
    if usd < 0:
        raise KeyFileError(f"{where}: `budget_usd` must be >= 0, got {value!r}")
    return int(usd * 1_000_000)


def parse_key(entry: dict, index: int) -> ApiKey:
    where = f"[[key]] #{index + 1}"
    known = {"name", "key", "key_sha256", "rps", "burst", "rpm", "tpm", "max_concurrency", "budget_usd",
             "budget_period", "models", "admin"}
    if unknown := set(entry) - known:
        raise KeyFileError(f"{where}: unknown field(s) {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise KeyFileError(f"{where}: `name` must be a non-empty string")
    where = f"[[key]] {name!r}"
    if ("key" in entry) == ("key_sha256" in entry):
        raise KeyFileError(f"{where}: give exactly one of `key` and `key_sha256`")
    if "key" in entry:
        if not isinstance(entry["key"], str) or not entry["key"]:
            raise KeyFileError(f"{where}: `key` must be a non-empty string")
        digest = hash_key(entry["key"])
    else:
        try:
            digest = bytes.fromhex(str(entry["key_sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise KeyFileError(f"{where}: `key_sha256` must be 64 hex digits")
    rps = _positive(entry, "rps", float, where)
    burst = _positive(entry, "burst", int, where)
    if burst is not None and rps is None:
        raise KeyFileError(f"{where}: `burst` needs `rps`")
    period = entry.get("budget_period", "month")
    if period not in PERIODS:
        raise KeyFileError(f"{where}: `budget_period` must be one of {PERIODS}, got {period!r}")
    models = entry.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise KeyFileError(f"{where}: `models` must be a list of model ids")
    return ApiKey(
        name=name, sha256=digest, rps=rps, burst=burst if burst is not None else (math.ceil(rps) if rps else None),
        rpm=_positive(entry, "rpm", int, where), tpm=_positive(entry, "tpm", int, where),
        max_concurrency=_positive(entry, "max_concurrency", int, where), budget_micro=_budget_micro(entry, where),
        budget_period=period, models=frozenset(models) if models is not None else None,
        admin=bool(entry.get("admin", False)),
    )


def load_keys(path: Path) -> list[ApiKey]:
    """Every key of the file; raises KeyFileError on any problem (nothing half-loaded)."""
    try:
        data = tomllib.loads(path.read_text(), parse_float=Decimal)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KeyFileError(f"cannot read the keys file {path}: {exc}") from exc
    entries = data.get("key", [])
    if not isinstance(entries, list):
        raise KeyFileError(f"{path}: expected [[key]] tables")
    keys = [parse_key(entry, i) for i, entry in enumerate(entries)]
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise KeyFileError(f"{path}: key names must be unique")
    if len({k.sha256 for k in keys}) != len(keys):
        raise KeyFileError(f"{path}: two entries hold the same key")
    return keys


class KeyStore:
    """The keys of one file, reloaded when it changes. `lookup` walks every key with hmac.compare_digest, so the
    time it takes does not depend on which key (or how much of one) matched."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._signature: tuple[int, int, int] | None = None
        self._checked = 0.0
        self.keys: list[ApiKey] = load_keys(self.path)  # a bad file at start is an error, not an empty key set
        self._signature = self._stat()
        self.last_error: str | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh(self) -> None:
        """Reload if the file changed since the last look (at most every POLL_INTERVAL_S)."""
        now = time.monotonic()
        if now - self._checked < POLL_INTERVAL_S:
            return
        with self._lock:
            self._checked = now
            signature = self._stat()
            if signature == self._signature:
                return
            self._signature = signature
            try:
                self.keys = load_keys(self.path)
                self.last_error = None
                logger.info("reloaded %d keys from %s", len(self.keys), self.path)
            except KeyFileError as exc:
                self.last_error = str(exc)
                logger.error("%s; keeping the %d keys loaded before", exc, len(self.keys))

    def lookup(self, secret: str) -> ApiKey | None:
        self.refresh()
        digest = hash_key(secret)
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.sha256, digest):
                found = key
        return found

    def by_name(self, name: str) -> ApiKey | None:
        return next((k for k in self.keys if k.name == name), None)
