"""Semantic context compression (glmserve/compress/): model-free quality against baselines at the same ratio.

    .venv/bin/python bench/bench_compress.py [--ratio 3.4] [--questions 40] [--out FILE]

Data, built offline: Debian Policy (`apt-get download debian-policy`, `dpkg-deb -x` into
$GLMSERVE_CACHE_DIR/bench/debian-policy, not committed; policy.txt, ~120K SmolLM2 tokens). Questions from
templates over its sentences (seed 0): cloze (a number, a date or a quoted term of a sentence blanked; the
answer is that exact span) and "which section says X" (the sentence with a third of its words dropped;
the gold is that sentence, whose span cites its section). The questions are split in two halves: "tune" and
"held-out" (no parameter was tuned on either; both are reported).

Every method keeps whole sentences to the same token budget (original / ratio, SmolLM2 tokens) in one run:
ours (glmserve.compress, query-aware), random sentence drop, head truncation, BM25 top-k, embedding top-k
(the same encoder as ours, cosine to the query). Metrics: answer-span retention (the answer's source
characters lie inside kept spans), gold-sentence recall, structural-anchor preservation, trace exactness
(each cited span is `source[start:end]` and appears in the output), achieved ratio, wall time (ours: the
first, cold call on the whole document, then the mean per question with the document's embeddings cached).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.compress import Document, compress  # noqa: E402
from glmserve.compress.anchors import detect, is_structural  # noqa: E402
from glmserve.compress.bm25 import bm25_scores  # noqa: E402
from glmserve.compress.segment import segment  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402
from glmserve.embed import embed  # noqa: E402
from glmserve.paths import cache_dir  # noqa: E402

_ANSWER = re.compile(r"\b\d+(?:\.\d+)+\b|\b\d{2,}\b|\"[^\"\n]{2,30}\"")


def debian_policy() -> str:
    root = cache_dir() / "bench" / "debian-policy"
    text_path = root / "usr/share/doc/debian-policy/policy.txt.gz"
    if not text_path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", "debian-policy"], cwd=tmp, check=True, timeout=300)
            deb = next(Path(tmp).glob("debian-policy_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
    return gzip.decompress(text_path.read_bytes()).decode("utf-8")


def make_questions(text: str, n: int, seed: int = 0) -> list[dict]:
    units = [u for u in segment("policy", text) if not u.heading and 60 <= len(u.text) <= 400]
    rng = random.Random(seed)
    rng.shuffle(units)
    out = []
    for u in units:
        if len(out) >= n:
            break
        if len(out) % 2 == 0:
            m = _ANSWER.search(u.text)
            if not m:
                continue
            query = u.text[:m.start()] + "____" + u.text[m.end():]
            out.append({"type": "cloze", "query": " ".join(query.split()), "gold": (u.start, u.end),
                        "answer": (u.start + m.start(), u.start + m.end())})
        else:
            words = u.text.split()
            kept = [w for w in words if rng.random() > 1 / 3]
            out.append({"type": "section", "query": "Which section says: " + " ".join(kept) + "?",
                        "gold": (u.start, u.end), "answer": (u.start, u.end), "section": u.section})
    return out


def covered(spans: list[tuple[int, int]], a: int, b: int) -> bool:
    return any(s <= a and b <= e for s, e in spans)


def baseline(units, costs: np.ndarray, order: np.ndarray, budget: int) -> list[tuple[int, int]]:
    fits = np.cumsum(costs[order]) <= budget
    keep = np.sort(order[fits])
    return [(units[i].start, units[i].end) for i in keep]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratio", type=float, default=3.4)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    text = debian_policy()
    count = default_counter()
    units = segment("policy", text)
    kinds = detect(units, text)
    structural = [(u.start, u.end) for u, k in zip(units, kinds) if is_structural(k)]
    costs = count([u.text for u in units]) + 1
    original = int(count([text])[0])
    budget = int(np.ceil(original / args.ratio))
    questions = make_questions(text, args.questions)
    doc = [Document("policy", text)]

    t0 = time.perf_counter()
    compress(doc, query=questions[0]["query"], ratio=args.ratio, count_tokens=count)
    cold_s = time.perf_counter() - t0

    unit_emb = embed([u.text for u in units])
    rng = np.random.default_rng(0)
    methods = ["ours", "random", "head", "bm25", "embedding"]
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for q in questions:
        kept: dict[str, list[tuple[int, int]]] = {}
        seconds: dict[str, float] = {}
        t = time.perf_counter()
        result = compress(doc, query=q["query"], ratio=args.ratio, count_tokens=count)
        seconds["ours"] = time.perf_counter() - t
        kept["ours"] = [(s.start, s.end) for s in result.spans]
        trace_ok = all(text[s.start:s.end] in result.text for s in result.spans)
        t = time.perf_counter()
        kept["random"] = baseline(units, costs, rng.permutation(len(units)), budget)
        seconds["random"] = time.perf_counter() - t
        t = time.perf_counter()
        kept["head"] = baseline(units, costs, np.arange(len(units)), budget)
        seconds["head"] = time.perf_counter() - t
        t = time.perf_counter()
        kept["bm25"] = baseline(units, costs, np.argsort(-bm25_scores([u.text for u in units], q["query"]),
                                                          kind="stable"), budget)
        seconds["bm25"] = time.perf_counter() - t
        t = time.perf_counter()
        kept["embedding"] = baseline(units, costs, np.argsort(-(unit_emb @ embed([q["query"]])[0]), kind="stable"),
                                     budget)
        seconds["embedding"] = time.perf_counter() - t
        for m in methods:
            spans = kept[m]
            out_tokens = result.compressed_tokens if m == "ours" else int(costs[[
                i for i, u in enumerate(units) if (u.start, u.end) in set(spans)]].sum())
            span_set = set(spans)
            rows[m].append({
                "type": q["type"], "answer": covered(spans, *q["answer"]), "gold": tuple(q["gold"]) in span_set,
                "anchors": sum(a in span_set for a in structural) / max(len(structural), 1),
                "trace": trace_ok if m == "ours" else True, "ratio": original / max(out_tokens, 1),
                "seconds": seconds[m]})

    half = len(questions) // 2
    report = {"original_tokens": original, "budget_tokens": budget, "units": len(units),
              "structural_anchors": len(structural), "questions": len(questions), "cold_seconds_ours": cold_s,
              "splits": {}}
    for split, sl in (("tune", slice(0, half)), ("held-out", slice(half, None)), ("all", slice(None))):
        table = {}
        for m in methods:
            r = rows[m][sl]
            cloze = [x for x in r if x["type"] == "cloze"]
            table[m] = {"answer_span_retention": float(np.mean([x["answer"] for x in cloze])),
                        "gold_sentence_recall": float(np.mean([x["gold"] for x in r])),
                        "anchor_preservation": float(np.mean([x["anchors"] for x in r])),
                        "trace_exact": float(np.mean([x["trace"] for x in r])),
                        "ratio": float(np.mean([x["ratio"] for x in r])),
                        "seconds_per_question": float(np.mean([x["seconds"] for x in r]))}
        report["splits"][split] = table
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
