"""RAG on compressed summaries (glmserve/compress/rag): records keep exact trace maps, a real Milvus Lite store
(a local .db) answers top-5 queries whose quotes are the source's exact substrings, the CLI, and (slow) the same
code against a separate Milvus server process (`milvus-lite server`) through --milvus-uri. Skipped where the
`rag` extra (pymilvus, milvus-lite) is not installed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from glmserve.cli import main
from glmserve.compress import Document
from glmserve.compress.rag import MilvusStore, build_index, make_records, query
from glmserve.compress.rag.records import chunk_records
from glmserve.errors import InvalidRequestError

pytest.importorskip("pymilvus", reason="the rag extra (pymilvus) is not installed")
pytest.importorskip("milvus_lite", reason="the rag extra (milvus-lite) is not installed")

TOPICS = {
    "Payment": "Invoices are paid within 30 days. Late payment bears interest at 2% per month. Fees are in euros.",
    "Delivery": "The Supplier ships the goods by sea freight. Risk passes to the Buyer at the port of loading.",
    "Warranty": "The goods are free of defects for 24 months. Defective parts are repaired or replaced free of charge.",
    "Confidentiality": "Each party keeps the other's trade secrets confidential for five years after termination.",
    "Termination": "Either party may end the agreement with 90 days written notice. Insolvency ends it at once.",
    "Governing law": "The agreement is governed by the laws of Sweden. Disputes go to arbitration in Stockholm.",
    "Data protection": "Personal data is processed only on documented instructions and deleted after the service.",
}
FILLER = "The parties discussed the matter at length and agreed to revisit it later in the year."


def contract() -> str:
    parts = ["SUPPLY AGREEMENT\n================"]
    for n, (title, body) in enumerate(TOPICS.items(), 1):
        parts += [f"{n}. {title}", f"{n}.1 {body} {FILLER}", FILLER + " " + FILLER]
    return "\n\n".join(parts)


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    text = contract()
    store = MilvusStore(str(tmp_path_factory.mktemp("rag") / "index.db"), "sections")
    records = make_records([Document("supply", text)], "summary", ratio=1.5)
    assert build_index(store, records) == len(records) and store.count() == len(records)
    yield store, text, records
    store.close()


def test_summary_records_trace_exactly(lite) -> None:
    _, text, records = lite
    assert {r.section for r in records} >= {str(n) for n in range(1, len(TOPICS) + 1)}
    for r in records:
        assert r.spans and r.start <= r.spans[0].start and r.spans[-1].end <= r.end
        for s in r.spans:
            assert r.quote(s) == text[s.start:s.end]  # the stored text holds each span verbatim
    # compressed: the sections' summaries are shorter than the sections, anchors are kept
    assert sum(len(r.text) for r in records) < len(text)
    assert all(any(s.kind == "anchor" for s in r.spans) for r in records if r.section != "")


def test_lite_query_top5_cites_source_offsets(lite) -> None:
    store, text, _ = lite
    hits = query(store, "How many days of notice are needed to end the agreement?", k=5)
    assert len(hits) == 5 and hits[0].score >= hits[-1].score
    assert "5" in [h.record.section for h in hits]  # 5. Termination
    for h in hits:
        for q in h.quotes:
            assert text[q.start:q.end] == q.text and q.doc == "supply"
    [top] = [h for h in hits if h.record.section == "5"]
    assert any("90 days" in q.text for q in top.quotes)


def test_chunk_baseline_and_errors(lite) -> None:
    store, text, _ = lite
    chunks = chunk_records("supply", text, words=20, overlap=5)
    assert all(text[c.start:c.end] == c.text for c in chunks) and chunks[-1].end == len(text.rstrip())
    assert all(len(c.text.split()) <= 20 for c in chunks)
    with pytest.raises(InvalidRequestError):
        chunk_records("supply", text, words=10, overlap=10)
    with pytest.raises(InvalidRequestError, match="ending in .db"):
        MilvusStore("/tmp/not-a-db-path", "x")
    with pytest.raises(InvalidRequestError, match="no index"):
        MilvusStore(store.uri, "missing").search(make_vec(), 5)
    with pytest.raises(InvalidRequestError, match="empty"):
        query(store, "  ")


def make_vec():
    import numpy as np

    v = np.zeros((1, 512), dtype=np.float32)
    v[0, 0] = 1.0
    return v


def test_cli_index_and_query(tmp_path, capsys) -> None:
    doc = tmp_path / "supply.txt"
    doc.write_text(contract(), encoding="utf-8")
    db = str(tmp_path / "cli.db")
    main(["rag", "index", str(doc), "--db", db, "--mode", "chunks", "--chunk-words", "40", "--collection", "chunks"])
    assert json.loads(capsys.readouterr().out)["records"] > 5
    main(["rag", "query", "Which country's law governs the agreement?", "--db", db, "--collection", "chunks",
          "--json"])
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 5 and any("Sweden" in q["text"] for h in hits for q in h["quotes"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_milvus_server_uri(tmp_path) -> None:
    """--milvus-uri: the same index and query against a separate Milvus server process (milvus-lite's gRPC server;
    a Milvus standalone answers the same protocol)."""
    port = _free_port()
    log = (tmp_path / "milvus.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(tmp_path / "data"),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "milvus.log").read_text()
            time.sleep(0.2)
        store = MilvusStore(f"http://127.0.0.1:{port}", "sections")
        build_index(store, make_records([Document("supply", contract())], "summary", ratio=1.5))
        hits = query(store, "Where are disputes arbitrated?", k=5)
        store.close()
        assert "6" in [h.record.section for h in hits]  # 6. Governing law
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
