"""RAG on compressed summaries vs plain fixed-size chunking (glmserve/compress/rag): recall@5, same embedder
(glmserve/compress/rag/vectors.py), same store (one Milvus Lite database, a collection per index), one run.

    PYTHONPATH=. .venv/bin/python bench/bench_rag.py [--corpus policy|licenses] [--questions 200] \
        [--ratios 1,2,3.4] [--chunk-words 64,128,256] [--out FILE]

Data, offline: Debian Policy (bench/bench_compress.py's `debian_policy()`: `apt-get download debian-policy`,
cached under $GLMSERVE_CACHE_DIR/bench) or the license texts Debian ships in /usr/share/common-licenses
(base-files; one document each, symlinked duplicates once). Questions by template over sentences of 60-400
characters (seed 0), three kinds in turn: cloze (a number, version, path or quoted term blanked; the answer is
that span), "which section says" (the sentence with a third of its words dropped; the answer is the sentence),
keywords (four of the sentence's content words, shuffled; the answer is the sentence). Shuffled, then the first
half is "tune" (the ratio and the chunk size are chosen on it, by answer recall@5) and the second "held-out".

Metrics per index, top 5 records: answer recall@5 (the answer span lies inside text the reader is handed: a
kept span of a summary, or a chunk), source recall@5 (the answer lies in the source range a record stands for:
its section, or the chunk), delivered tokens (SmolLM2 tokens of the 5 records' texts), build and query times.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from glmserve.compress import Document  # noqa: E402
from glmserve.compress.rag import MilvusStore, build_index, make_records  # noqa: E402
from glmserve.compress.rag.vectors import passage_vectors  # noqa: E402
from glmserve.compress.segment import segment  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402

_BLANK = re.compile(r"/[\w.+-]+(?:/[\w.+-]+)+|\b\d+(?:\.\d+)+\b|\b\d{2,}\b|[\"'`][^\"'`\n]{2,30}[\"'`]")
_CONTENT = re.compile(r"[A-Za-z][A-Za-z-]{4,}")
_STOP = frozenset("which where there these those their about would should could shall other under being".split())
LICENSES = Path("/usr/share/common-licenses")


def corpus(name: str) -> list[Document]:
    if name == "policy":
        from bench_compress import debian_policy

        return [Document("policy", debian_policy())]
    seen, docs = set(), []
    for path in sorted(LICENSES.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        docs.append(Document(path.name, real.read_text(encoding="utf-8", errors="replace")))
    return docs


def make_questions(docs: list[Document], n: int, seed: int = 0) -> list[dict]:
    units = [(d.id, u) for d in docs for u in segment(d.id, d.text) if not u.heading and 60 <= len(u.text) <= 400]
    rng = random.Random(seed)
    rng.shuffle(units)
    out: list[dict] = []
    for doc, u in units:
        if len(out) >= n:
            break
        kind = ("cloze", "section", "keywords")[len(out) % 3]
        if kind == "cloze":
            m = _BLANK.search(u.text)
            if not m:
                continue
            q = u.text[:m.start()] + "____" + u.text[m.end():]
            answer = (u.start + m.start(), u.start + m.end())
        elif kind == "section":
            q = "Which section says: " + " ".join(w for w in u.text.split() if rng.random() > 1 / 3) + "?"
            answer = (u.start, u.end)
        else:
            words = list(dict.fromkeys(w.lower() for w in _CONTENT.findall(u.text) if w.lower() not in _STOP))
            if len(words) < 4:
                continue
            picked = rng.sample(words, 4)
            q = "Where does it say anything about: " + ", ".join(picked) + "?"
            answer = (u.start, u.end)
        out.append({"kind": kind, "query": " ".join(q.split()), "doc": doc, "answer": answer})
    rng.shuffle(out)
    return out


def evaluate(store: MilvusStore, records, questions: list[dict], k: int, count) -> tuple[list[dict], float]:
    q_vecs = passage_vectors([q["query"] for q in questions])
    t = time.perf_counter()
    results = store.search(q_vecs, k)
    query_s = (time.perf_counter() - t) / len(questions)
    tokens = {(r.doc, r.start, r.end): int(n) for r, n in zip(records, count([r.text for r in records]))}
    rows = []
    for q, hits in zip(questions, results):
        a, b = q["answer"]
        mine = [r for _, r in hits if r.doc == q["doc"]]
        rows.append({"kind": q["kind"],
                     "answer": any(s.start <= a and b <= s.end for r in mine for s in r.spans),
                     "source": any(r.start <= a and b <= r.end for r in mine),
                     "tokens": sum(tokens[(r.doc, r.start, r.end)] for _, r in hits)})
    return rows, query_s


def summarize(rows: list[dict]) -> dict:
    return {"answer_recall@5": float(np.mean([r["answer"] for r in rows])),
            "source_recall@5": float(np.mean([r["source"] for r in rows])),
            "delivered_tokens": float(np.mean([r["tokens"] for r in rows])),
            "by_kind": {k: float(np.mean([r["answer"] for r in rows if r["kind"] == k]))
                        for k in ("cloze", "section", "keywords")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", choices=["policy", "licenses"], default="policy")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--ratios", default="1,2,3.4", help="summary compression ratios (1: sections whole)")
    ap.add_argument("--chunk-words", default="64,128,256")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--db", default=None, help="Milvus Lite .db path (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    docs = corpus(args.corpus)
    count = default_counter()
    questions = make_questions(docs, args.questions)
    half = len(questions) // 2
    splits = {"tune": slice(0, half), "held-out": slice(half, None)}
    tmp = tempfile.TemporaryDirectory()
    store_uri = args.db or str(Path(tmp.name) / "bench_rag.db")
    configs = [("summary", float(r)) for r in args.ratios.split(",")] + \
              [("chunks", int(w)) for w in args.chunk_words.split(",")]
    report = {"corpus": args.corpus, "documents": len(docs), "source_tokens": int(count([d.text for d in docs]).sum()),
              "questions": len(questions), "k": args.k, "indexes": {}}
    for mode, value in configs:
        name = f"{mode}-{value:g}"
        t = time.perf_counter()
        records = make_records(docs, mode, ratio=float(value), chunk_words=int(value), count=count)
        store = MilvusStore(store_uri, name.replace(".", "_").replace("-", "_"))
        build_index(store, records)
        build_s = time.perf_counter() - t
        rows, query_s = evaluate(store, records, questions, args.k, count)
        store.close()
        entry = {"mode": mode, "value": value, "records": len(records),
                 "stored_tokens": int(count([r.text for r in records]).sum()), "build_seconds": build_s,
                 "search_seconds_per_question": query_s,
                 "splits": {s: summarize(rows[sl]) for s, sl in splits.items()}}
        report["indexes"][name] = entry
        print(name, json.dumps(entry["splits"]), f"build {build_s:.1f} s", flush=True)
    for mode in ("summary", "chunks"):
        best = max((n for n, e in report["indexes"].items() if e["mode"] == mode),
                   key=lambda n: (report["indexes"][n]["splits"]["tune"]["answer_recall@5"],
                                  -report["indexes"][n]["splits"]["tune"]["delivered_tokens"]))
        report[f"chosen_{mode}"] = best
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
