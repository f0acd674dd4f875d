"""Reading and writing record files: JSONL (one JSON object per line), Parquet or CSV (the review sample, for
spreadsheets) by suffix, each written to a temporary file and renamed so that nothing is left half-written."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from glmserve.errors import InvalidRequestError


def jsonl_lines(path: Path, errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSONL file; a line that is not JSON gives its
    `json.JSONDecodeError` as the value. `errors`: how undecodable UTF-8 is read (`open`'s argument)."""
    with open(path, encoding="utf-8", errors=errors) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                yield n, e


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a line that is not a JSON object with a string `text` is an error."""
    for n, rec in jsonl_lines(path):
        if isinstance(rec, json.JSONDecodeError):
            raise InvalidRequestError(f"{path}:{n}: not valid JSON ({rec.msg})") from rec
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise InvalidRequestError(f"{path}:{n}: a record must be a JSON object with a string 'text'")
        yield rec


def iter_csv(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a CSV file with a header line that names a `text` column."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if "text" not in (reader.fieldnames or []):
            raise InvalidRequestError(f"{path}: the CSV file has no 'text' column in its header")
        yield from reader


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a .jsonl, .parquet or .csv file."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"input file {p} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        if "text" not in table.column_names:
            raise InvalidRequestError(f"{p}: the Parquet file has no 'text' column")
        yield from table.to_pylist()
    elif p.suffix == ".csv":
        yield from iter_csv(p)
    else:
        yield from iter_jsonl(p)


def count_records(path: str | Path) -> int:
    """Number of records (validating every one)."""
    return sum(1 for _ in read_records(path))


def write_records(path: str | Path, data: Iterable[dict[str, Any]] | dict[str, Any]) -> None:
    """JSONL, Parquet or CSV (records; CSV columns are the keys of the first record) or one indented JSON
    document (.json), atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        if p.suffix == ".parquet":
            os.close(fd)
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(data)), tmp)
        elif p.suffix == ".csv":
            rows = list(data)
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["id", "text"])
                writer.writeheader()
                writer.writerows(rows)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                if p.suffix == ".json":
                    json.dump(data, f, ensure_ascii=False, indent=2)
                else:
                    for rec in data:
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
