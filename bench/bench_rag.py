"""RAG on compressed summaries vs plain fixed-size chunking (glmserve/compress/rag) at equal tokens handed to the
reader: same embedder (glmserve/compress/rag/vectors.py), same store (one Milvus Lite database, a collection per
index), one run.

    PYTHONPATH=. .venv/bin/python bench/bench_rag.py [--corpus policy|licenses] [--questions 200] \
        [--key-ratios 1,2,3.4] [--chunk-words 64,128,256] [--reads 3,5,8] [--out FILE]

Data, offline: Debian Policy (bench/compress_data.py's `debian_policy()`: `apt-get download debian-policy`,
cached under $GLMSERVE_CACHE_DIR/bench) or the license texts Debian ships in /usr/share/common-licenses
(base-files; one document each, symlinked duplicates once). Questions by template over sentences of 60-400
characters (seed 0), three kinds in turn: cloze (a number, version, path or quoted term blanked; the answer is
that span), "which section says" (the sentence with a third of its words dropped; the answer is the sentence),
keywords (four of the sentence's content words, shuffled; the answer is the sentence). Shuffled, then the first
half is "tune" (every choice below is made on it) and the second "held-out".

Indexes: plain chunks of N words (top 5 handed over whole: the baseline; found by their vectors as before, by
BM25, or by both fused: the strong baseline, chosen on tune), and parent indexes: whole sections as
records, their summary's sentences and anchors at key ratio R (R = 1: every sentence) as keys with vectors of
their own (glmserve rag index --mode sections). Retrieval methods on a parent index (retrieve.py): mean (one
vector per section), maxsim (best key), bm25 (best key by BM25), anchors (exact-match keys) and their fusions
by reciprocal rank; measured by section recall@k (the answer lies in one of the top k sections). Reading
(read.py): the top k sections compressed together for the question to, per question, the tokens the N-word
chunk baseline handed over for it, so both readers get the same number of tokens (ours never more).

Choices on tune: the key ratio and method by section recall@5, then per budget the number of sections k by
answer recall. Metrics: answer recall (the answer span lies inside text handed to the reader), tokens handed
over (SmolLM2 tokens of that text), per split. `--ratios` adds the earlier design, one mean vector per
query-agnostic section summary at ratio R, with its top 5 summaries handed over.
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
from glmserve.compress.rag import MilvusStore, build_index, make_parents, make_records, rank, read  # noqa: E402
from glmserve.compress.rag.vectors import passage_vectors  # noqa: E402
from glmserve.compress.segment import segment  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402

_BLANK = re.compile(r"/[\w.+-]+(?:/[\w.+-]+)+|\b\d+(?:\.\d+)+\b|\b\d{2,}\b|[\"'`][^\"'`\n]{2,30}[\"'`]")
_CONTENT = re.compile(r"[A-Za-z][A-Za-z-]{4,}")
_STOP = frozenset("which where there these those their about would should could shall other under being".split())
LICENSES = Path("/usr/share/common-licenses")
METHODS = ("mean", "maxsim", "bm25", "anchors", "maxsim+bm25", "maxsim+bm25+anchors", "mean+maxsim+bm25")
CHUNK_METHODS = ("mean", "bm25", "mean+bm25")
RANKED = 10  # sections ranked per question (recall@1..10)


def corpus(name: str) -> list[Document]:
    if name == "policy":
        from compress_data import debian_policy

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


def whole_eval(records, ranked: list[list[tuple[int, float]]], questions: list[dict], record_tokens) -> list[dict]:
    """The retrieved records handed over whole (chunks, or the earlier summaries)."""
    rows = []
    for q, r in zip(questions, ranked):
        a, b = q["answer"]
        mine = [records[i] for i, _ in r if records[i].doc == q["doc"]]
        rows.append({"kind": q["kind"], "answer": any(s.start <= a and b <= s.end for x in mine for s in x.spans),
                     "tokens": int(sum(record_tokens[i] for i, _ in r))})
    return rows


def section_rank(records, ranked: list[tuple[int, float]], q: dict) -> int:
    """1-based rank of the first retrieved section holding the answer; 0 when none of them does."""
    a, b = q["answer"]
    for n, (i, _) in enumerate(ranked, 1):
        r = records[i]
        if r.doc == q["doc"] and r.start <= a and b <= r.end:
            return n
    return 0


def per_split(rows: list[dict], splits: dict[str, slice]) -> dict:
    """Answer recall, mean tokens handed over and answer recall by question kind, per split."""
    out = {}
    for name, sl in splits.items():
        part = rows[sl]
        out[name] = {"answer": float(np.mean([r["answer"] for r in part])),
                     "tokens": float(np.mean([r["tokens"] for r in part])),
                     "by_kind": {k: float(np.mean([r["answer"] for r in part if r["kind"] == k]))
                                 for k in ("cloze", "section", "keywords")}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", choices=["policy", "licenses"], default="policy")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--key-ratios", default="1,2,3.4", help="summary ratios of the parent indexes' keys")
    ap.add_argument("--chunk-words", default="64,128,256")
    ap.add_argument("--reads", default="3,5,8", help="numbers of top sections compressed for the reader")
    ap.add_argument("--ratios", default="", help="also the earlier one-vector-per-summary indexes at these ratios")
    ap.add_argument("--k", type=int, default=5, help="chunks (and earlier summaries) handed over")
    ap.add_argument("--db", default=None, help="Milvus Lite .db path (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    docs = corpus(args.corpus)
    count = default_counter()
    questions = make_questions(docs, args.questions)
    texts = [q["query"] for q in questions]
    half = len(questions) // 2
    splits = {"tune": slice(0, half), "held-out": slice(half, None)}
    tmp = tempfile.TemporaryDirectory()
    store_uri = args.db or str(Path(tmp.name) / "bench_rag.db")
    report: dict = {"corpus": args.corpus, "documents": len(docs),
                    "source_tokens": int(count([d.text for d in docs]).sum()), "questions": len(questions),
                    "k": args.k, "chunks": {}, "summaries": {}, "parents": {}, "reads": {}}
    t = time.perf_counter()
    q_vecs = passage_vectors(texts)
    report["question_embed_seconds"] = time.perf_counter() - t

    # the baseline: plain chunks of N words, top k handed over whole, found by their vectors (mean: the earlier
    # baseline, whose per-question tokens are the readers' budgets), by BM25, or by both fused (each chunk is its
    # own single key)
    budgets: dict[int, list[int]] = {}
    for words in [int(w) for w in args.chunk_words.split(",")]:
        t = time.perf_counter()
        records = make_records(docs, "chunks", chunk_words=words)
        store = MilvusStore(store_uri, f"chunks_{words}")
        build_index(store, records, [(i, r.spans[0]) for i, r in enumerate(records)])
        build_s = time.perf_counter() - t
        record_tokens = count([r.text for r in records])
        entry = {"records": len(records), "build_seconds": build_s, "methods": {}}
        for method in CHUNK_METHODS:
            rows = whole_eval(records, rank(store, texts, q_vecs, args.k, method), questions, record_tokens)
            if method == "mean":
                budgets[words] = [r["tokens"] for r in rows]
            entry["methods"][method] = per_split(rows, splits)
        store.close()
        entry["chosen_method"] = max(CHUNK_METHODS, key=lambda m: entry["methods"][m]["tune"]["answer"])
        report["chunks"][words] = entry
        print(f"chunks {words}", json.dumps(entry["methods"]), f"build {build_s:.1f} s", flush=True)

    # the earlier design, for the record: one mean vector per query-agnostic summary, top k summaries handed over
    for ratio in [float(r) for r in args.ratios.split(",") if r]:
        records = make_records(docs, "summary", ratio=ratio, count=count)
        store = MilvusStore(store_uri, f"summary_{ratio:g}".replace(".", "_"))
        build_index(store, records)
        rows = whole_eval(records, rank(store, texts, q_vecs, args.k, "mean"), questions,
                          count([r.text for r in records]))
        store.close()
        report["summaries"][f"{ratio:g}"] = {"records": len(records), "splits": per_split(rows, splits)}
        print(f"summary {ratio:g}", json.dumps(report["summaries"][f"{ratio:g}"]["splits"]), flush=True)

    # parent indexes: whole sections, keys at each ratio; section recall@k of every retrieval method
    ranked_by: dict[tuple[str, str], list[list[tuple[int, float]]]] = {}
    parents: dict[str, list] = {}
    stores: dict[str, MilvusStore] = {}
    for key_ratio in [float(r) for r in args.key_ratios.split(",")]:
        name = f"{key_ratio:g}"
        t = time.perf_counter()
        records, keys = make_parents(docs, key_ratio, count)
        store = MilvusStore(store_uri, f"parents_{name}".replace(".", "_"))
        build_index(store, records, keys)
        build_s = time.perf_counter() - t
        parents[name], stores[name] = records, store
        section_tokens = count([r.text for r in records])
        entry: dict = {"records": len(records), "keys": len(keys), "build_seconds": build_s, "methods": {}}
        for method in METHODS:
            t = time.perf_counter()
            ranked = rank(store, texts, q_vecs, RANKED, method)
            rank_s = (time.perf_counter() - t) / len(questions)
            ranked_by[(name, method)] = ranked
            ranks = np.array([section_rank(records, r, q) for r, q in zip(ranked, questions)])
            whole = [int(sum(section_tokens[i] for i, _ in r[:args.k])) for r in ranked]
            entry["methods"][method] = {"seconds_per_question": rank_s, "splits": {
                s: {f"recall@{k}": float(np.mean((ranks[sl] > 0) & (ranks[sl] <= k))) for k in (1, 3, 5, 10)}
                | {"whole_top5_tokens": float(np.mean(whole[sl]))} for s, sl in splits.items()}}
        report["parents"][name] = entry
        print(f"parents {name}", json.dumps({m: e["splits"] for m, e in entry["methods"].items()}),
              f"build {build_s:.1f} s", flush=True)

    def tune_recall(key: tuple[str, str]) -> tuple[float, float]:
        s = report["parents"][key[0]]["methods"][key[1]]["splits"]["tune"]
        return s["recall@5"], s["recall@3"]

    chosen = max(ranked_by, key=tune_recall)
    report["chosen_retrieval"] = {"key_ratio": chosen[0], "method": chosen[1]}
    records, ranked = parents[chosen[0]], ranked_by[chosen]

    # retrieve-then-compress at each chunk size's per-question tokens
    for words, budget in budgets.items():
        per_k = {}
        for k in [int(x) for x in args.reads.split(",")]:
            rows, t = [], time.perf_counter()
            for q, r, b in zip(questions, ranked, budget):
                ans = read([records[i] for i, _ in r[:k]], q["query"], b, [s for _, s in r[:k]], count)
                a0, b0 = q["answer"]
                rows.append({"kind": q["kind"], "tokens": ans.tokens,
                             "answer": any(x.doc == q["doc"] and x.start <= a0 and b0 <= x.end for x in ans.quotes)})
            per_k[k] = {"seconds_per_question": (time.perf_counter() - t) / len(questions),
                        "splits": per_split(rows, splits)}
        best_k = max(per_k, key=lambda k: (per_k[k]["splits"]["tune"]["answer"], -k))
        report["reads"][words] = {"chosen_k": best_k, "by_k": per_k}
        print(f"read at chunks-{words} tokens", json.dumps({k: v["splits"] for k, v in per_k.items()}),
              f"chosen k={best_k}", flush=True)
    for store in stores.values():
        store.close()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
