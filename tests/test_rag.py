"""RAG on compressed summaries (glmserve/compress/rag): records keep exact trace maps, a real Milvus Lite store
(a local .db) answers top-5 queries whose quotes are the source's exact substrings; the parent-section index
(keys with vectors and BM25 of their own), the fused retrieval and retrieve-then-compress with traced answers;
the CLI, and (slow) the same code against a separate Milvus server process (`milvus-lite server`) through
--milvus-uri. Skipped where the `rag` extra (pymilvus, milvus-lite) is not installed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from glmserve.cli import main
from glmserve.compress import Document
from glmserve.compress.locate import Locator
from glmserve.compress.rag import MilvusStore, ask, build_index, make_parents, make_records, query, rank, read
from glmserve.compress.rag.records import chunk_records
from glmserve.compress.rag.retrieve import DEFAULT_METHOD, anchor_terms, parse_method, rrf
from glmserve.compress.rag.vectors import passage_vectors
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
        MilvusStore(store.uri, "missing").search_ids(make_vec(), 5)
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
          "--read", "quotes", "--json"])
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 5 and any("Sweden" in q["text"] for h in hits for q in h["quotes"])
    assert {h["retrieval"] for h in hits} == {"mean"}  # auto: an index without keys is searched by its vectors
    # the default: whole sections keyed by their sentences, read compressed for the question, quotes traced
    main(["rag", "index", str(doc), "--db", db])
    assert json.loads(capsys.readouterr().out)["keys"] > 7
    main(["rag", "query", "Which country's law governs the agreement?", "--db", db, "--target-tokens", "80",
          "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert answer["retrieval"] == DEFAULT_METHOD and 0 < answer["tokens"] <= 80
    assert any("Sweden" in q["text"] for q in answer["quotes"])
    assert all(contract()[q["start"]:q["end"]] == q["text"] and q["text"] in answer["text"] for q in answer["quotes"])


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
        assert "6" in [h.record.section for h in hits]  # 6. Governing law
        build_index(store, *make_parents([Document("supply", contract())]))  # keys with BM25 on the server too
        answer = ask(store, "Where are disputes arbitrated?", k=3, target_tokens=60)
        store.close()
        assert answer.sections[0].section == "6" and any("Stockholm" in q.text for q in answer.quotes)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    text = contract()
    records, keys = make_parents([Document("supply", text)])
    store = MilvusStore(str(tmp_path_factory.mktemp("rag") / "parents.db"), "parents")
    assert build_index(store, records, keys) == len(records) and store.has_keys()
    yield store, text, records, keys
    store.close()


def test_parent_records_are_whole_sections_and_keys_point_into_them(parents) -> None:
    _, text, records, keys = parents
    for r in records:
        assert r.text == text[r.start:r.end]  # the exact source range, so the reader's compression can cite it
        assert all(r.quote(s) == text[s.start:s.end] for s in r.spans)
    # every sentence is a key (key ratio 1); a summary at ratio 2 keys fewer sentences, anchors among them
    assert len(keys) == sum(len(r.spans) for r in records)
    fewer, few_keys = make_parents([Document("supply", text)], key_ratio=2.0)
    assert [r.text for r in fewer] == [r.text for r in records] and len(few_keys) < len(keys)
    for i, s in few_keys:
        assert fewer[i].start <= s.start < s.end <= fewer[i].end and fewer[i].quote(s) == text[s.start:s.end]
    assert {fewer[i].section for i, s in few_keys if s.kind == "anchor"} >= {str(n) for n in range(2, 8)}


def test_fused_retrieval_ranks_sections_by_their_keys(parents) -> None:
    store, _, records, _ = parents
    questions = ["Where do disputes go to arbitration?", "Stockholm arbitration Sweden laws", "What does 4.1 say?"]
    vecs = passage_vectors(questions)
    for method in ("maxsim", "bm25", "maxsim+bm25", "mean+maxsim+bm25"):
        top = [records[r[0][0]].section for r in rank(store, questions[:2], vecs[:2], 3, method)]
        assert top == ["6", "6"], method  # 6. Governing law
    [anchored] = rank(store, questions[2:], vecs[2:], 3, "anchors")
    assert [records[i].section for i, _ in anchored] == ["4"]  # the key "4.1 The goods are free of defects ..."
    fused = rank(store, questions, vecs, 3, "maxsim+bm25+anchors")
    assert all(len(r) == 3 and r[0][1] >= r[1][1] >= r[2][1] for r in fused)


def test_rrf_anchor_terms_and_method_errors() -> None:
    # 1: 1/61 + 1/62, 3: 1/63 + 1/61, 2: 1/62
    assert [i for i, _ in rrf([[1, 2, 3], [3, 1]], 3)] == [1, 3, 2]
    assert anchor_terms('Does Section 4.2 put Build-Depends in /usr/share/doc or "debian/control"? GPL') == [
        "4.2", "Build-Depends", "/usr/share/doc", "debian/control", "GPL"]
    assert parse_method("bm25+maxsim+bm25") == ("bm25", "maxsim")
    for bad in ("", "dense", "maxsim+dense"):
        with pytest.raises(InvalidRequestError, match="retrieval method"):
            parse_method(bad)


def test_ask_compresses_retrieved_sections_to_the_budget_with_traced_quotes(parents) -> None:
    store, text, records, _ = parents
    loc = Locator("supply", text)
    answer = ask(store, "How many days of notice are needed to end the agreement?", k=3, target_tokens=70)
    assert answer.sections[0].section == "5" and 0 < answer.tokens <= 70
    assert sum(len(r.text) for r in answer.sections) > len(answer.text)  # compressed, not handed over whole
    assert any("90 days" in q.text for q in answer.quotes)
    for q in answer.quotes:
        c = loc.cite(q.start, q.end)
        assert text[q.start:q.end] == q.text and q.text in answer.text and q.doc == "supply"
        assert (q.section, q.paragraph, q.page) == (c.section, c.paragraph, c.page)
    assert "anchor" in {q.kind for q in answer.quotes} <= {"anchor", "narrative"}  # headings and clauses verbatim
    # a budget the whole sections fit in hands them over whole
    whole = read(answer.sections, "notice", 10_000)
    assert "".join(q.text for q in whole.quotes) == "".join("".join(r.quote(s) for s in r.spans)
                                                            for r in answer.sections)


def test_read_and_rank_errors(parents, lite) -> None:
    store, _, _, _ = parents
    summaries = lite[2]
    with pytest.raises(InvalidRequestError, match="whole-section"):
        read(summaries[:2], "notice", 100)  # summaries are not exact source ranges
    with pytest.raises(InvalidRequestError, match="target_tokens"):
        read([], "notice", 0)
    with pytest.raises(InvalidRequestError, match="no keys"):
        rank(lite[0], ["notice"], passage_vectors(["notice"]), 3, "maxsim")
    with pytest.raises(InvalidRequestError, match="k must be"):
        rank(store, ["notice"], passage_vectors(["notice"]), 0)
    with pytest.raises(InvalidRequestError, match="exact-match term"):
        store.records_with('say "hi"')
    assert store.records_with("Stockholm") and not store.records_with("Oslo")
