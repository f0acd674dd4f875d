"""The billing ledger: one row per answered request id, in SQLite (default) or PostgreSQL.

A row is written in one transaction (never half a row) before the response's last bytes reach the client, and
writing the same request id twice keeps the first row (idempotent). Requests refused before a backend answered
(401, 429, ...) write nothing. Money is integer micro-USD.

URLs: `sqlite:///ABSOLUTE/PATH` or `sqlite:///relative/path` (three slashes, then the path), or
`postgresql://user@host/db` (psycopg). None: `ledger.sqlite3` under glmserve.paths.cache_dir().
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from glmserve.errors import InvalidRequestError
from glmserve.paths import cache_dir


class LedgerError(InvalidRequestError):
    """A ledger URL that names no supported database, or a database that cannot be opened."""


@dataclass(frozen=True)
class LedgerRow:
    request_id: str
    ts_ms: int  # unix time in milliseconds
    key_name: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    price_version: str
    cost_micro: int  # billed
    list_cost_micro: int  # cached input priced as plain input
    streamed: bool


COLUMNS = [f.name for f in fields(LedgerRow)]
_TYPES = {"request_id": "TEXT PRIMARY KEY", "ts_ms": "BIGINT NOT NULL", "key_name": "TEXT NOT NULL",
          "model": "TEXT NOT NULL", "price_version": "TEXT NOT NULL", "streamed": "BOOLEAN NOT NULL"}
SCHEMA = ("CREATE TABLE IF NOT EXISTS ledger (" + ", ".join(f"{c} {_TYPES.get(c, 'BIGINT NOT NULL')}"
                                                         for c in COLUMNS) + ")")
INDEX = "CREATE INDEX IF NOT EXISTS ledger_key_ts ON ledger (key_name, ts_ms)"


@dataclass(frozen=True)
class UsageSummary:
    """Sums over ledger rows (one key and model, or all)."""

    key_name: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micro: int
    list_cost_micro: int

    @property
    def saving_micro(self) -> int:
        return self.list_cost_micro - self.cost_micro


_SUMS = ("SELECT key_name, model, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), "
         "SUM(cost_micro), SUM(list_cost_micro) FROM ledger WHERE ts_ms >= {p}{key} GROUP BY key_name, model "
         "ORDER BY key_name, model")


class Ledger:
    """A SQL ledger; one connection used under a lock (writes come from the event loop via a worker thread)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or f"sqlite:///{cache_dir() / 'ledger.sqlite3'}"
        self._lock = threading.Lock()
        if self.url.startswith("sqlite:///"):
            path = Path(self.url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL commits survive a killed process
                self._conn.execute("PRAGMA busy_timeout=5000")
                self._conn.execute(SCHEMA)
                self._conn.execute(INDEX)
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot open the SQLite ledger {path}: {exc}") from exc
            self._param = "?"
            self._insert_tail = " ON CONFLICT (request_id) DO NOTHING"
        elif self.url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError as exc:
                raise LedgerError("a postgresql:// ledger needs psycopg (pip install 'psycopg[binary]')") from exc
            try:
                self._conn = psycopg.connect(self.url, autocommit=True)
                self._conn.execute(SCHEMA)
                self._conn.execute(INDEX)
            except psycopg.Error as exc:
                raise LedgerError(f"cannot open the PostgreSQL ledger: {exc}") from exc
            self._param = "%s"
            self._insert_tail = " ON CONFLICT (request_id) DO NOTHING"
        else:
            raise LedgerError(f"unsupported ledger URL {self.url!r} (sqlite:///PATH or postgresql://...)")
        marks = ", ".join([self._param] * len(COLUMNS))
        self._insert = f"INSERT INTO ledger ({', '.join(COLUMNS)}) VALUES ({marks}){self._insert_tail}"

    def record(self, row: LedgerRow) -> bool:
        """Write `row` (one autocommitted statement); False if that request id already has a row."""
        with self._lock:
            cur = self._conn.execute(self._insert, astuple(row))
            return cur.rowcount == 1

    def rows(self, since_ms: int = 0) -> list[LedgerRow]:
        with self._lock:
            cur = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM ledger WHERE ts_ms >= {self._param} "
                                     "ORDER BY ts_ms, request_id", (since_ms,))
            return [LedgerRow(*r[:-1], bool(r[-1])) for r in cur.fetchall()]

    def summary(self, since_ms: int = 0, key_name: str | None = None) -> list[UsageSummary]:
        """Sums per key and model since `since_ms` (one key's, or every key's)."""
        key_clause = f" AND key_name = {self._param}" if key_name is not None else ""
        params: tuple = (since_ms, key_name) if key_name is not None else (since_ms,)
        with self._lock:
            cur = self._conn.execute(_SUMS.format(p=self._param, key=key_clause), params)
            return [UsageSummary(r[0], r[1], *(int(v or 0) for v in r[2:])) for r in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def now_ms() -> int:
    return time.time_ns() // 1_000_000
