"""Semantic context compression (glmserve/compress/) against baselines at the same ratio, with and without the model.

    .venv/bin/python bench/bench_compress.py [--ratio 3.4] [--questions 40] [--zh-questions 20]
        [--multi-questions 12] [--parts routing,multi,en,zh] [--no-model] [--out FILE]

Corpora and questions: bench/compress_data.py (Debian Policy, ~120K tokens; the Chinese New Maintainers' Guide;
five license texts with the gold one first, in the middle or last; a code-routing corpus). Each corpus's
questions are split in two halves, "tune" and "held-out" (no parameter was tuned on either; both are reported).

Every method keeps whole sentences of the same units to the same token budget (original / ratio, SmolLM2
tokens), per question, in one run: ours (glmserve.compress, query-aware), random sentence drop, head
truncation, BM25 top-k, embedding top-k (the same encoder as ours, cosine to the query). Model-free metrics:
answer-span retention (cloze: the answer's source characters lie inside a kept span; "which section": the gold
sentence is kept), gold-sentence recall, structural-anchor preservation, trace exactness (each cited span is
`source[start:end]` and appears in the output), achieved ratio, wall time (ours: the first, cold call on the
document, then the mean per question with its embeddings cached). With the model (bench/compress_logprob.py):
the gold answer's log-probability lost per answer token, compressed window vs gold section. Code routing: the
share of code files routed "off", and of prose, licenses, policy text and Markdown with code blocks routed "on".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compress_data import (  # noqa: E402
    Question,
    debian_policy,
    license_text,
    maint_guide_zh,
    make_questions,
    routing_corpus,
)
from compress_logprob import AnswerScorer, join_units, section_window  # noqa: E402

from glmserve.compress import Document, compress  # noqa: E402
from glmserve.compress.anchors import detect, is_structural  # noqa: E402
from glmserve.compress.bm25 import bm25_scores  # noqa: E402
from glmserve.compress.policy import route  # noqa: E402
from glmserve.compress.segment import segment  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402
from glmserve.embed import embed  # noqa: E402

METHODS = ("ours", "random", "head", "bm25", "embedding")
GOLD_LICENSE = "GPL-3"
DISTRACTORS = ("Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic")


@dataclass
class Corpus:
    name: str
    documents: list[Document]
    questions: list[Question]


def corpora(parts: set[str], n_en: int, n_zh: int, n_multi: int) -> list[Corpus]:
    out = []
    if "multi" in parts:
        gpl = license_text(GOLD_LICENSE)
        multi_q = make_questions(segment(GOLD_LICENSE, gpl), n_multi, seed=1)
        others = [Document(name, license_text(name)) for name in DISTRACTORS]
        for where, at in (("first", 0), ("middle", len(others) // 2), ("last", len(others))):
            docs = [*others[:at], Document(GOLD_LICENSE, gpl), *others[at:]]
            out.append(Corpus(f"5 licenses, gold {where}", docs, multi_q))
    if "en" in parts:
        policy = debian_policy()
        out.append(Corpus("Debian Policy (en)", [Document("policy", policy)],
                          make_questions(segment("policy", policy), n_en)))
    if "zh" in parts:
        guide = maint_guide_zh()
        out.append(Corpus("New Maintainers' Guide (zh)", [Document("guide", guide)],
                          make_questions(segment("guide", guide), n_zh, chinese=True)))
    return out


def top_k(costs: np.ndarray, order: np.ndarray, budget: int) -> set[int]:
    fits = np.cumsum(costs[order]) <= budget
    return set(order[fits].tolist())


def baseline_order(method: str, query: str, unit_texts: list[str], unit_emb: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    """The units in the order a baseline keeps them until the budget is spent."""
    if method == "random":
        return rng.permutation(len(unit_texts))
    if method == "head":
        return np.arange(len(unit_texts))
    if method == "bm25":
        return np.argsort(-bm25_scores(unit_texts, query), kind="stable")
    return np.argsort(-(unit_emb @ embed([query])[0]), kind="stable")


def run_corpus(corpus: Corpus, ratio: float, count, rng: np.random.Generator) -> dict:
    docs = corpus.documents
    units = [u for d in docs for u in segment(d.id, d.text)]
    texts = {d.id: d.text for d in docs}
    kinds = [k for d in docs for k in detect([u for u in units if u.doc == d.id], d.text)]
    structural = {i for i, k in enumerate(kinds) if is_structural(k)}
    index = {(u.doc, u.start, u.end): i for i, u in enumerate(units)}
    costs = count([u.text for u in units]) + 1
    original = int(count([d.text for d in docs]).sum())
    budget = int(np.ceil(original / ratio))

    t0 = time.perf_counter()
    compress(docs, query=corpus.questions[0].query, ratio=ratio, count_tokens=count)
    cold_s = time.perf_counter() - t0
    print(f"{corpus.name}: {original} tokens, {len(units)} units, cold call {cold_s:.1f} s", file=sys.stderr,
          flush=True)
    unit_emb = embed([u.text for u in units])
    unit_texts = [u.text for u in units]

    rows = []
    for q in corpus.questions:
        kept: dict[str, set[int]] = {}
        seconds: dict[str, float] = {}
        t = time.perf_counter()
        result = compress(docs, query=q.query, ratio=ratio, count_tokens=count)
        seconds["ours"] = time.perf_counter() - t
        kept["ours"] = {index[(s.doc, s.start, s.end)] for s in result.spans}
        trace_ok = all(texts[s.doc][s.start:s.end] in result.text for s in result.spans)
        for m in ("random", "head", "bm25", "embedding"):
            t = time.perf_counter()
            kept[m] = top_k(costs, baseline_order(m, q.query, unit_texts, unit_emb, rng), budget)
            seconds[m] = time.perf_counter() - t
        gold = index[(q.doc, *q.gold)]
        window = section_window(units, costs, gold)
        row = {"type": q.type, "window": join_units(units, window), "prompt": q.prompt, "answer": q.answer_text,
               "methods": {}}
        for m in METHODS:
            k = kept[m]
            a, b = q.answer
            out_tokens = result.compressed_tokens if m == "ours" else int(costs[sorted(k)].sum())
            row["methods"][m] = {
                "answer": any(units[i].doc == q.doc and units[i].start <= a and b <= units[i].end for i in k),
                "gold": gold in k,
                "anchors": len(structural & k) / max(len(structural), 1),
                "trace": trace_ok if m == "ours" else True,
                "ratio": original / max(out_tokens, 1),
                "seconds": seconds[m],
                "context": join_units(units, [i for i in window if i in k]),
            }
        rows.append(row)
        print(f"  question {len(rows)}/{len(corpus.questions)}: ours {seconds['ours']:.1f} s", file=sys.stderr,
              flush=True)
    return {"name": corpus.name, "documents": [d.id for d in docs], "original_tokens": original,
            "budget_tokens": budget, "units": len(units), "structural_anchors": len(structural),
            "cold_seconds_ours": cold_s, "rows": rows}


def add_model_metric(scorer: AnswerScorer, res: dict) -> None:
    """Fills each method's `logprob_loss` (nats per answer token) and each row's `gold_logprob`."""
    items, where = [], []
    for q, row in enumerate(res["rows"]):
        for m in (None, *METHODS):
            context = row["window"] if m is None else row["methods"][m]["context"]
            items.append((f"{context}\n\n{row['prompt']}\nAnswer:", row["answer"]))
            where.append((q, m))
    t = time.perf_counter()
    for (q, m), (lp, n) in zip(where, scorer.score(items)):
        row = res["rows"][q]
        if m is None:
            row["gold_logprob"] = lp / n
        else:
            row["methods"][m]["logprob"] = lp / n
    for row in res["rows"]:
        for m in METHODS:
            row["methods"][m]["logprob_loss"] = row["gold_logprob"] - row["methods"][m]["logprob"]
    print(f"  model metric: {len(items)} prompts in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)


def summary(res: dict) -> dict:
    half = len(res["rows"]) // 2
    out = {}
    for split, rows in (("tune", res["rows"][:half]), ("held-out", res["rows"][half:])):
        table = {}
        for m in METHODS:
            ms = [row["methods"][m] for row in rows]
            cloze = [row["methods"][m] for row in rows if row["type"] == "cloze"]
            table[m] = {"answer_span_retention": float(np.mean([x["answer"] for x in ms])),
                        "cloze_answer_retention": float(np.mean([x["answer"] for x in cloze])) if cloze else None,
                        "gold_sentence_recall": float(np.mean([x["gold"] for x in ms])),
                        "anchor_preservation": float(np.mean([x["anchors"] for x in ms])),
                        "trace_exact": float(np.mean([x["trace"] for x in ms])),
                        "ratio": float(np.mean([x["ratio"] for x in ms])),
                        "seconds_per_question": float(np.mean([x["seconds"] for x in ms]))}
            if "logprob_loss" in ms[0]:
                table[m]["logprob_loss_nats_per_token"] = float(np.mean([x["logprob_loss"] for x in ms]))
        if rows and "gold_logprob" in rows[0]:
            table["gold_logprob_nats_per_token"] = float(np.mean([row["gold_logprob"] for row in rows]))
        out[split] = table
    return out


ROUTING_SEEDS = {"tune": 0, "held-out": 2}  # the rules were written looking at seeds 0 and 1, never at 2


def routing(policy: str, guide: str, seed: int) -> dict:
    """Share of each kind of text routed "off" (files sampled with `seed`)."""
    code, prose = routing_corpus(seed=seed)

    def chunks(text: str, size: int = 4000) -> list[str]:
        paras, out, cur = text.split("\n\n"), [], ""
        for p in paras:
            cur += p + "\n\n"
            if len(cur) >= size:
                out.append(cur)
                cur = ""
        return out

    prose = {**prose, "Debian Policy (4K-char chunks)": chunks(policy), "Chinese guide (4K-char chunks)": chunks(guide)}
    table = {}
    for group, kinds in (("code", code), ("prose", prose)):
        for kind, texts in kinds.items():
            table[f"{group}: {kind}"] = {"files": len(texts),
                                         "routed_off": float(np.mean([route(t).mode == "off" for t in texts]))}
    all_code = [route(t).mode == "off" for texts in code.values() for t in texts]
    table["code: all"] = {"files": len(all_code), "routed_off": float(np.mean(all_code))}
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratio", type=float, default=3.4)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--zh-questions", type=int, default=20)
    ap.add_argument("--multi-questions", type=int, default=12)
    ap.add_argument("--parts", default="routing,multi,en,zh", help="comma-separated: routing, multi, en, zh")
    ap.add_argument("--no-model", action="store_true", help="skip the model metric")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    count = default_counter()
    rng = np.random.default_rng(0)
    parts = set(args.parts.split(","))
    report: dict = {"ratio": args.ratio, "corpora": []}
    if "routing" in parts:
        report["routing"] = {split: routing(debian_policy(), maint_guide_zh(), seed)
                             for split, seed in ROUTING_SEEDS.items()}
    all_rows: list[list[dict]] = []

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
            Path(args.out).with_suffix(".rows.json").write_text(json.dumps(all_rows, ensure_ascii=False))

    save()
    scorer = None if args.no_model else AnswerScorer()
    for c in corpora(parts, args.questions, args.zh_questions, args.multi_questions):  # report rewritten after each
        res = run_corpus(c, args.ratio, count, rng)
        if scorer is not None:
            add_model_metric(scorer, res)
        report["corpora"].append({k: v for k, v in res.items() if k != "rows"}
                                 | {"questions": len(res["rows"]), "splits": summary(res)})
        all_rows.append(res["rows"])
        save()
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
