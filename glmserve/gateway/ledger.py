"""The billing ledger: one row per answered request id, in SQLite (default) or PostgreSQL.

A row is written in one transaction (never half a row) before the response's last bytes reach the client, and
writing the same request id twice keeps the first row (idempotent). `Ledger.write` (the gateway's path) is a group
commit: one writer thread takes every row waiting and commits them in one transaction, and each caller resumes
after its row's commit, so a gateway killed with SIGKILL has billed exactly the usage its clients received, while
under load many rows share one commit and one thread wake-up. SQLite's WAL checkpoints (which fsync) run in a
thread of their own with its own connection, never inside a commit that requests wait on (their ~10-30 ms were
the commit path's p99: bench/RESULTS.md "Gateway"). Requests refused before a backend answered
(401, 429, ...) write nothing. Money is integer micro-USD.

URLs: `sqlite:///ABSOLUTE/PATH` or `sqlite:///relative/path` (three slashes, then the path), or
`postgresql://user@host/db` (psycopg). None: `ledger.sqlite3` under glmserve.paths.cache_dir().
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


_Pending = tuple[LedgerRow, asyncio.Future, asyncio.AbstractEventLoop]
CHECKPOINT_EVERY_S = 1.0  # how often the checkpointer thread moves the SQLite WAL into the database file


class Ledger:
    """A SQL ledger; one connection used under a lock (the event loop's rows go through one writer thread)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or f"sqlite:///{cache_dir() / 'ledger.sqlite3'}"
        self._lock = threading.Lock()
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._checkpoints: _Checkpointer | None = None  # SQLite only
        if self.url.startswith("sqlite:///"):
            path = Path(self.url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL commits survive a killed process
                self._conn.execute("PRAGMA busy_timeout=5000")
                self._conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it, off commits
                self._conn.execute(SCHEMA)
                self._conn.execute(INDEX)
            except sqlite3.Error as exc:
                raise LedgerError(f"cannot open the SQLite ledger {path}: {exc}") from exc
            self._checkpoints = _Checkpointer(path)
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

    def record_many(self, rows: list[LedgerRow]) -> list[bool | Exception]:
        """Write `rows` in one transaction; per row, whether it was new. Should the transaction fail, each row is
        written on its own, so one bad row costs only its own write (its exception in its place)."""
        try:
            with self._lock, self._transaction():
                return [self._conn.execute(self._insert, astuple(row)).rowcount == 1 for row in rows]
        except Exception:
            if len(rows) == 1:
                raise
        results: list[bool | Exception] = []
        for row in rows:
            try:
                results.append(self.record(row))
            except Exception as exc:  # handed to that row's caller
                results.append(exc)
        return results

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        if self._param == "%s":  # psycopg, autocommit: an explicit transaction block
            with self._conn.transaction():
                yield
            return
        self._conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    async def write(self, row: LedgerRow) -> bool:
        """`record(row)` by the writer thread, batched with the rows other requests wait on; returns once the row
        is committed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="ledger-writer", daemon=True)
            self._writer.start()
        self._pending.put((row, future, loop))
        return await future

    def _write_loop(self) -> None:
        while True:
            batch = [self._pending.get()]
            while not self._pending.empty() and batch[-1] is not None:
                batch.append(self._pending.get_nowait())
            stop = batch[-1] is None
            items = [item for item in batch if item is not None]
            if items:
                try:
                    results: list[bool | Exception] = self.record_many([row for row, _, _ in items])
                except Exception as exc:  # handed to the callers
                    results = [exc] * len(items)
                for loop in {loop for _, _, loop in items}:
                    done = [(fut, res) for (_, fut, lp), res in zip(items, results) if lp is loop]
                    with suppress(RuntimeError):  # that event loop is closed: nobody waits any more
                        loop.call_soon_threadsafe(_resolve, done)
            if stop:
                return

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
        """Commits the rows still waiting (their callers resume), then closes the connection."""
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()
            self._writer = None
        if self._checkpoints is not None:
            self._checkpoints.stop()
        with self._lock:
            self._conn.close()


class _Checkpointer:
    """Runs SQLite's PASSIVE WAL checkpoint every CHECKPOINT_EVERY_S on its own connection (it waits for no writer
    and no writer waits for it; the WAL would otherwise grow without bound with autocheckpoint off)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=5000")
            while not self._stopping.wait(CHECKPOINT_EVERY_S):
                self._checkpoint(conn)
            self._checkpoint(conn)
        finally:
            conn.close()

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection) -> None:
        with suppress(sqlite3.Error):  # busy or locked: the next round moves what is left
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


def _resolve(done: list[tuple[asyncio.Future, bool | Exception]]) -> None:
    for future, result in done:
        if future.cancelled():
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)


def now_ms() -> int:
    return time.time_ns() // 1_000_000
