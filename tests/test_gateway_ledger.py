"""The billing ledger on a real SQLite file and a real PostgreSQL cluster (started by the test with initdb and
pg_ctl; skipped where PostgreSQL is not installed): one row per request id (idempotent), sums per key and model,
concurrent writers, the gateway's group commit, and `glmserve billing report` (with and without the cached-input
discount)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import postgres_server, unavailable

from glmserve.gateway.billing import report
from glmserve.gateway.ledger import Ledger, LedgerError, LedgerRow


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    url = request.getfixturevalue("postgres_url")
    ledger = Ledger(url)
    ledger._conn.execute("DROP TABLE IF EXISTS ledger")  # each test starts empty
    ledger.close()
    yield url


def _row(rid: str, key: str = "a", model: str = "m", prompt: int = 100, cached: int = 40, out: int = 10,
         cost: int = 7, listed: int = 9, ts: int = 1_000) -> LedgerRow:
    return LedgerRow(rid, ts, key, model, prompt, cached, out, "v1", cost, listed, False)


def test_rows_are_idempotent_per_request_id_and_summed(ledger_url: str) -> None:
    ledger = Ledger(ledger_url)
    assert ledger.record(_row("r1"))
    assert not ledger.record(_row("r1", prompt=999))  # the same id again keeps the first row
    ledger.record(_row("r2", model="m2", cost=5, listed=5))
    ledger.record(_row("r3", key="b", ts=5_000))
    rows = ledger.rows()
    assert [r.request_id for r in rows] == ["r1", "r2", "r3"] and rows[0].prompt_tokens == 100
    assert rows[0] == _row("r1")
    sums = {(s.key_name, s.model): s for s in ledger.summary()}
    assert sums[("a", "m")].requests == 1 and sums[("a", "m")].saving_micro == 2
    assert [s.key_name for s in ledger.summary(since_ms=2_000)] == ["b"]
    assert [s.model for s in ledger.summary(key_name="a")] == ["m", "m2"]
    ledger.close()


def test_concurrent_writers_lose_nothing(ledger_url: str) -> None:
    ledger = Ledger(ledger_url)

    def write(worker: int) -> None:
        for i in range(50):
            ledger.record(_row(f"w{worker}-{i}", cost=worker))
            ledger.record(_row(f"w{worker}-{i}", cost=1000))  # a retried write: ignored

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = ledger.rows()
    assert len(rows) == 200 and sum(r.cost_micro for r in rows) == 50 * (0 + 1 + 2 + 3)
    ledger.close()


def test_group_commit_writes_each_row_once_and_one_bad_row_fails_alone(ledger_url: str) -> None:
    ledger = Ledger(ledger_url)

    async def burst() -> list[bool | BaseException]:
        writes = [ledger.write(_row(f"g{i % 100}", cost=i)) for i in range(200)]  # each id twice, concurrently
        writes.insert(50, ledger.write(_row("bad", key=None)))  # NOT NULL: that row's write fails, the batch not
        return await asyncio.gather(*writes, return_exceptions=True)

    results = asyncio.run(burst())
    assert isinstance(results.pop(50), Exception)
    assert results.count(True) == 100 and results.count(False) == 100
    ledger.close()  # and it can be opened again: the writer thread is gone
    reopened = Ledger(ledger_url)
    rows = reopened.rows()
    reopened.close()
    assert sorted(r.request_id for r in rows) == sorted(f"g{i}" for i in range(100))
    assert sum(r.cost_micro for r in rows) == sum(range(100))  # the first write of each id (in queue order) wins


def test_sqlite_checkpoints_run_off_the_commit_path_and_move_the_wal_into_the_file(tmp_path: Path) -> None:
    """Commits never checkpoint (autocheckpoint off on the writer's connection); the checkpointer thread moves
    the WAL's pages into the database file on its own, so the file grows while the ledger stays open."""
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(f"sqlite:///{path}")
    assert ledger._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    empty_size = path.stat().st_size
    ledger.record_many([_row(f"c{i}", model="m" * 200) for i in range(500)])
    deadline = time.monotonic() + 30
    while path.stat().st_size <= empty_size and time.monotonic() < deadline:
        time.sleep(0.1)
    grown = path.stat().st_size
    ledger.close()
    assert grown > empty_size, "the rows never left the WAL for the database file"
    assert len(Ledger(f"sqlite:///{path}").rows()) == 500


def test_billing_report_shows_the_saving(ledger_url: str) -> None:
    ledger = Ledger(ledger_url)
    ledger.record(_row("r1", cost=620_000, listed=1_000_000))
    ledger.close()
    text = report(ledger_url)
    assert "0.620000" in text and "1.000000" in text and "0.380000" in text and "38.0%" in text
    out = subprocess.run([sys.executable, "-m", "glmserve.cli", "billing", "report", "--ledger", ledger_url,
                          "--since", "1970-01-01", "--json"], capture_output=True, text=True, check=True).stdout
    assert '"saving_usd": "0.380000"' in out


def test_bad_ledger_urls_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="unsupported ledger URL"):
        Ledger("mysql://x")
    with pytest.raises(LedgerError, match="cannot open the SQLite ledger"):
        Ledger(f"sqlite:///{tmp_path}")  # a directory
