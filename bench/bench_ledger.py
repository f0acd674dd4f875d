"""How long a billed request waits for its ledger row's commit (glmserve/gateway/ledger.py `Ledger.write`), with
SQLite's WAL checkpoints in the checkpointer thread (the default) and, for comparison, inside the commits as
SQLite does by default (`--inline-checkpoints`: autocheckpoint 1000 pages on the writer's connection), interleaved
in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_ledger.py --rows 6000 --rate 500 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from glmserve.gateway.ledger import Ledger, LedgerRow


async def _wait_times(ledger: Ledger, rows: int, rate: float) -> list[float]:
    waits: list[float] = []

    async def one(i: int) -> None:
        row = LedgerRow(request_id=f"r{i}", ts_ms=i, key_name="bench", model="m", prompt_tokens=100,
                        cached_tokens=40, completion_tokens=20, price_version="v1", cost_micro=7,
                        list_cost_micro=9, streamed=False)
        started = time.perf_counter()
        await ledger.write(row)
        waits.append(time.perf_counter() - started)

    tasks = []
    for i in range(rows):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)
    return sorted(waits)


def measure(inline_checkpoints: bool, rows: int, rate: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(f"sqlite:///{Path(tmp) / 'ledger.sqlite3'}")
        if inline_checkpoints:
            ledger._conn.execute("PRAGMA wal_autocheckpoint=1000")  # SQLite's default: the commit checkpoints
            ledger._checkpoints.stop()  # and no checkpointer thread, as before it existed
            ledger._checkpoints = None
        try:
            waits = asyncio.run(_wait_times(ledger, rows, rate))
        finally:
            ledger.close()
    pick = {"p50": 0.5, "p99": 0.99, "p999": 0.999, "max": 1.0}
    return {name: round(1e3 * waits[min(len(waits) - 1, int(q * len(waits)))], 2) for name, q in pick.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--rate", type=float, default=500.0, help="rows per second")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for repeat in range(args.repeats):
        for inline in (repeat % 2 == 1, repeat % 2 == 0):  # order alternates per repeat
            result = {"checkpoints": "inline" if inline else "thread", "repeat": repeat,
                      **measure(inline, args.rows, args.rate)}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
