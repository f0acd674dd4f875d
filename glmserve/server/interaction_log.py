"""`serve --log-interactions DIR`: one JSONL line per finished request (and per client feedback), written by a
background thread so that neither the event loop nor the engine thread waits on the disk.

Files are `interactions-YYYYMMDD-NNN.jsonl` (UTC day, NNN counts up), created with mode 0600 (they hold what
users typed), and rotate when a line would take one past `max_bytes` or the day changes. A record that cannot
be written (disk full, directory gone) is dropped and counted in `glmserve_interaction_log_errors_total`, the
first failure logged once; a full queue drops and counts too (`..._dropped_total`). A request never fails
because of its log line. `glmserve data feedback DIR` reads these files (glmserve/data/feedback.py).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Counter

logger = logging.getLogger(__name__)
FILE_PREFIX = "interactions-"
DEFAULT_MAX_BYTES = 64 << 20
QUEUE_RECORDS = 10_000
_STOP = object()


def _day(t: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(t))


class InteractionLog:
    """Append-only JSONL files in `directory`; `submit` never blocks and never raises."""

    def __init__(self, directory: str | Path, registry: CollectorRegistry | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1024:
            raise ValueError(f"the interaction log's max bytes per file must be >= 1024, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)  # a bad DIR fails the start, not the first request
        self.max_bytes = max_bytes
        self.written = Counter("glmserve_interaction_log_records", "Lines written to the interaction log",
                               registry=registry)
        self.errors = Counter("glmserve_interaction_log_errors", "Interaction log lines that could not be written "
                              "(disk full, directory gone): dropped", registry=registry)
        self.dropped = Counter("glmserve_interaction_log_dropped", "Interaction log lines dropped because the "
                               "writer queue was full", registry=registry)
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_RECORDS)
        self._file: TextIO | None = None
        self._file_day = ""
        self._file_bytes = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="interaction-log", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any]) -> None:
        """Queues one line (`time` added when absent); a full queue drops it and counts."""
        record.setdefault("time", time.time())
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped.inc()

    def close(self, timeout_s: float = 10.0) -> None:
        """Writes what is queued, then stops the thread and closes the file."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not _STOP and not self._queue.empty():  # drain, then flush once
                item = self._queue.get_nowait()
                batch.append(item)
            for record in batch:
                if record is not _STOP:
                    self._write(record)
            self._flush()
            if batch[-1] is _STOP:
                if self._file is not None:
                    self._file.close()
                return

    def _write(self, record: dict[str, Any]) -> None:
        try:
            line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
            size = len(line.encode("utf-8"))
            day = _day(record["time"])
            if self._file is None or day != self._file_day or self._file_bytes + size > self.max_bytes:
                self._open(day)
            assert self._file is not None
            self._file.write(line)
            self._file_bytes += size
            self.written.inc()
            self._failing = False
        except (OSError, TypeError, ValueError) as exc:
            self._failed(exc)

    def _flush(self) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.errors.inc()
        if not self._failing:  # once per run of failures, not once per line
            logger.error("interaction log: cannot write to %s (%s); lines are dropped and counted in "
                         "glmserve_interaction_log_errors_total", self.directory, exc)
        self._failing = True
        if self._file is not None:  # reopen (next file) on the next line: a freed disk or new directory works again
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _open(self, day: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.directory.mkdir(parents=True, exist_ok=True)
        taken = [p.name for p in self.directory.glob(f"{FILE_PREFIX}{day}-*.jsonl")]
        n = 1 + max((int(name[len(FILE_PREFIX) + 9:-6]) for name in taken
                     if name[len(FILE_PREFIX) + 9:-6].isdigit()), default=0)
        path = self.directory / f"{FILE_PREFIX}{day}-{n:03d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._file_day, self._file_bytes = day, 0
