"""Semantic context compression (glmserve/compress/) against baselines at the same ratio, with and without the model.

    .venv/bin/python bench/bench_compress.py [--ratio 3.4] [--questions 40] [--zh-questions 20]
        [--multi-questions 12] [--parts routing,multi,en,zh,licenses] [--positions first,second,middle,fourth,last]
        [--license-questions 400] [--qset paraphrased|template] [--split tune|held-out|both]
        [--no-model] [--model-questions N] [--llmlingua N] [--llmlingua-dtype float32|bfloat16] [--out FILE]

Corpora and questions: bench/compress_data.py (Debian Policy, ~120K tokens; the Chinese New Maintainers' Guide;
five license texts with GPL-3 the gold one, first, in the middle or last ("multi"); a code-routing corpus) and the
larger license set ("licenses"): each of ten other license texts as the gold among four distractors of other
license families, at each position of `--positions`, its questions from another seed; its corpora are also
summarized per gold position over all ten golds (`groups` in the report). Question sets:
"paraphrased" (bench/compress_questions.py: questions worded with the heading and neighbour sentences, or through a
synonym table, never quoting their answer sentence; the default) or "template" (compress_data.make_questions: cloze
and "which section", which quote it). Each set has a "tune" and a "held-out" split, reported apart; `--split` runs
one of them. Per question the bench reports how paraphrased it is: the share of its content words found in the
gold sentence, and the BM25 rank of the gold sentence among all units for the question.

Every method keeps whole sentences of the same units to the same token budget (original / ratio, SmolLM2
tokens), per question, in one run: ours (glmserve.compress, query-aware), random sentence drop, head
truncation, BM25 top-k, embedding top-k (the same encoder as ours, cosine to the query), and with `--llmlingua N`
LongLLMLingua's document ranking (bench/peer_llmlingua.py in its own venv: chunks of consecutive units of at most
CHUNK_TOKENS, ranked by llmlingua with the exported SmolLM2 as its scorer, kept best first to the budget) on the
first N questions of each split (it reads the whole document once per question). Model-free metrics:
answer-span retention (cloze: the answer's source characters lie inside a kept span; "which section": the gold
sentence is kept), gold-sentence recall, structural-anchor preservation, trace exactness (each cited span is
`source[start:end]` and appears in the output), achieved ratio, wall time (ours: the first, cold call on the
document, then the mean per question with its embeddings cached). With the model (bench/compress_logprob.py):
the gold answer's log-probability lost per answer token, compressed window vs gold section (on the first
`--model-questions` of each split). Answer retention comes with a 95% bootstrap interval and, per baseline, the
paired difference ours - baseline with its interval ("clearly above": the interval's low end > 0). Code routing: the
share of code files routed "off", and of prose, licenses, policy text and Markdown with code blocks routed "on".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compress_data import (  # noqa: E402
    debian_policy,
    license_distractors,
    license_text,
    maint_guide_zh,
    make_questions,
    routing_corpus,
)
from compress_logprob import AnswerScorer, join_units, section_window  # noqa: E402
from compress_questions import make_paraphrased  # noqa: E402

from glmserve.compress import Document, compress, select  # noqa: E402
from glmserve.compress.anchors import detect, is_structural  # noqa: E402
from glmserve.compress.bm25 import bm25_scores, words  # noqa: E402
from glmserve.compress.policy import route  # noqa: E402
from glmserve.compress.segment import segment  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402
from glmserve.embed import embed  # noqa: E402

METHODS = ("ours", "ours_no_context", "random", "head", "bm25", "embedding", "llmlingua")
BASELINES = METHODS[1:]
CHUNK_TOKENS = 256  # LongLLMLingua's "documents": runs of consecutive units of one document up to this many tokens
BENCH_DIR = Path(os.environ.get("GLMSERVE_BENCH_DIR", Path.home() / ".cache" / "glmserve-bench"))
TEMPLATE_SHELL = set(words("Fill in the blank: Which section says 填空：哪一节说"))
GOLD_LICENSE = "GPL-3"
DISTRACTORS = ("Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic")
POSITIONS = {"first": 0, "second": 1, "middle": 2, "fourth": 3, "last": 4}  # the gold's index among 5 documents
# The larger license set (part "licenses"): each distinct license text of base-files in turn as the gold, except
# GPL-3 (the multi set's gold: the neighbour weight was chosen on its tune split), near-copies of another (GFDL-1.2
# of GFDL-1.3, LGPL-2 of LGPL-2.1; GPL, LGPL and GFDL are links) and BSD (no sentence to ask about); 4 distractors
# of other families per gold, drawn with LICENSES_SEED, which also seeds the questions (the multi set used 1).
LICENSE_GOLDS = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-1", "GPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1",
                 "MPL-2.0")
LICENSE_POOL = (*LICENSE_GOLDS, "GPL-3", "BSD")
LICENSES_SEED = 17


@dataclass
class Corpus:
    name: str
    documents: list[Document]
    questions: list[dict]  # Question / ParaQuestion fields, with split and cue_words
    group: str = ""  # corpora of one group are also summarized together (the licenses set: one per gold position)


def question_set(qset: str, units: list, n: int, chinese: bool = False, seed: int = 0) -> list[dict]:
    """The questions as dicts with `split` and `cue_words` (template questions: halves, the query's words)."""
    if qset == "paraphrased":
        return [q.__dict__ for q in make_paraphrased(units, n, chinese=chinese, seed=seed)]
    qs = make_questions(units, n, chinese=chinese, seed=seed)
    return [q.__dict__ | {"split": "tune" if i < len(qs) // 2 else "held-out",
                          "cue_words": tuple(w for w in words(q.query) if w not in TEMPLATE_SHELL)}
            for i, q in enumerate(qs)]


def with_gold_at(gold: Document, others: list[Document], where: str) -> list[Document]:
    """The 4 distractors with the gold document inserted at position `where` (a key of POSITIONS)."""
    if where not in POSITIONS:
        raise SystemExit(f"unknown gold position {where!r}: one of {', '.join(POSITIONS)}")
    at = POSITIONS[where]
    return [*others[:at], gold, *others[at:]]


def corpora(parts: set[str], n_en: int, n_zh: int, n_multi: int, qset: str = "paraphrased",
            split: str = "both", positions: tuple[str, ...] = ("first", "middle", "last"),
            n_licenses: int = 400) -> list[Corpus]:
    out = []
    if "multi" in parts:
        gpl = Document(GOLD_LICENSE, license_text(GOLD_LICENSE))
        multi_q = question_set(qset, segment(gpl.id, gpl.text), n_multi, seed=1)
        others = [Document(name, license_text(name)) for name in DISTRACTORS]
        for where in positions:
            out.append(Corpus(f"5 licenses, gold {where}", with_gold_at(gpl, others, where), multi_q))
    if "licenses" in parts:
        for name in LICENSE_GOLDS:
            gold = Document(name, license_text(name))
            qs = question_set(qset, segment(gold.id, gold.text), n_licenses, seed=LICENSES_SEED)
            others = [Document(d, license_text(d)) for d in license_distractors(name, LICENSE_POOL, 4, LICENSES_SEED)]
            for where in positions:
                out.append(Corpus(f"licenses: {name} {where}", with_gold_at(gold, others, where), qs,
                                  group=f"licenses, gold {where}"))
    if "en" in parts:
        policy = debian_policy()
        out.append(Corpus("Debian Policy (en)", [Document("policy", policy)],
                          question_set(qset, segment("policy", policy), n_en)))
    if "zh" in parts:
        guide = maint_guide_zh()
        out.append(Corpus("New Maintainers' Guide (zh)", [Document("guide", guide)],
                          question_set(qset, segment("guide", guide), n_zh, chinese=True)))
    for c in out:
        c.questions = [q for q in c.questions if split in ("both", q["split"])]
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


def chunks_of(units: list, costs: np.ndarray, limit: int = CHUNK_TOKENS) -> list[list[int]]:
    """Runs of consecutive units of one document, each at most `limit` tokens (a longer unit alone)."""
    out: list[list[int]] = []
    used = 0
    for i, u in enumerate(units):
        if out and units[out[-1][-1]].doc == u.doc and used + int(costs[i]) <= limit:
            out[-1].append(i)
            used += int(costs[i])
        else:
            out.append([i])
            used = int(costs[i])
    return out


class LongLLMLingua:
    """bench/peer_llmlingua.py in its venv, its scorer in `dtype`. Each question's ranking is appended to a
    cache file (BENCH_DIR/llmlingua-ranks.jsonl, keyed by a hash of the scorer, its dtype, the question and the
    chunk texts) as soon as the peer prints it, so a run cut short keeps what it finished and a rerun on the same
    questions and chunks (the license variants: the same chunks in another document order) scores nothing again."""

    def __init__(self, dtype: str = "float32") -> None:
        self.python = BENCH_DIR / "llmlingua" / "bin" / "python"
        self.model = BENCH_DIR / "smollm2-bf16"
        self.dtype = dtype
        self.path = BENCH_DIR / "llmlingua-ranks.jsonl"
        if not self.python.exists() or not (self.model / "config.json").exists():
            raise SystemExit(f"--llmlingua needs {self.python} and {self.model}: run bench/setup_peers.sh llmlingua")
        self.cache: dict[str, dict] = {}  # key -> {"order": chunk indices best first, "seconds": wall time}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                got = json.loads(line)
                self.cache[got["key"]] = got

    def key(self, chunk_texts: list[str], question: str) -> str:
        h = hashlib.sha256(json.dumps([str(self.model), self.dtype, question, sorted(chunk_texts)]).encode())
        return h.hexdigest()

    def orders(self, chunk_texts: list[str], questions: list[str]) -> tuple[list[np.ndarray], list[float]]:
        canon = sorted(range(len(chunk_texts)), key=lambda c: chunk_texts[c])  # the order the peer is given
        todo = [q for q in questions if self.key(chunk_texts, q) not in self.cache]
        if todo:
            env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
            cmd = [str(self.python), str(Path(__file__).with_name("peer_llmlingua.py")), "--model", str(self.model),
                   "--dtype", self.dtype]
            with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as proc:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(json.dumps({"chunks": [chunk_texts[c] for c in canon], "questions": todo}))
                proc.stdin.close()
                for q, line in zip(todo, proc.stdout):
                    got = json.loads(line) | {"key": self.key(chunk_texts, q)}
                    self.cache[got["key"]] = got
                    with self.path.open("a") as f:
                        f.write(json.dumps(got) + "\n")
            if proc.returncode != 0:
                raise SystemExit(f"peer_llmlingua.py failed ({proc.returncode}); its stderr is above")
        out = []
        for q in questions:
            rank = {canon[c]: r for r, c in enumerate(self.cache[self.key(chunk_texts, q)]["order"])}
            out.append(np.array([rank[c] for c in range(len(chunk_texts))]).argsort(kind="stable"))
        return out, [self.cache[self.key(chunk_texts, q)]["seconds"] for q in questions]


def llmlingua_subset(questions: list[dict], n: int) -> list[int]:
    """Indices of the first `n` questions (or rows) of each split."""
    seen: dict[str, int] = {}
    out = []
    for i, q in enumerate(questions):
        seen[q["split"]] = seen.get(q["split"], 0) + 1
        if seen[q["split"]] <= n:
            out.append(i)
    return out


def without_context(docs: list[Document], query: str, ratio: float, count) -> set[tuple[str, int, int]]:
    """Ours with both neighbour weights at 0 (the selection before select.with_neighbours): the ablation."""
    saved = select.NEIGHBOUR_WEIGHT, select.BETWEEN_WEIGHT
    select.NEIGHBOUR_WEIGHT = select.BETWEEN_WEIGHT = 0.0
    try:
        result = compress(docs, query=query, ratio=ratio, count_tokens=count)
    finally:
        select.NEIGHBOUR_WEIGHT, select.BETWEEN_WEIGHT = saved
    return {(s.doc, s.start, s.end) for s in result.spans}


def run_corpus(corpus: Corpus, ratio: float, count, rng: np.random.Generator,
               lingua: LongLLMLingua | None = None, n_lingua: int = 0, ablate: bool = False) -> dict:
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
    compress(docs, query=corpus.questions[0]["query"], ratio=ratio, count_tokens=count)
    cold_s = time.perf_counter() - t0
    print(f"{corpus.name}: {original} tokens, {len(units)} units, cold call {cold_s:.1f} s", file=sys.stderr,
          flush=True)
    unit_emb = embed([u.text for u in units])
    unit_texts = [u.text for u in units]

    lingua_kept: dict[int, tuple[set[int], float]] = {}
    if lingua is not None and n_lingua > 0:
        chunks = chunks_of(units, costs)
        chunk_costs = np.array([int(costs[c].sum()) for c in chunks])
        subset = llmlingua_subset(corpus.questions, n_lingua)
        t = time.perf_counter()
        orders, secs = lingua.orders([join_units(units, c) for c in chunks],
                                     [corpus.questions[i]["query"] for i in subset])
        for i, order, sec in zip(subset, orders, secs):
            lingua_kept[i] = ({u for c in top_k(chunk_costs, order, budget) for u in chunks[c]}, sec)
        print(f"  LongLLMLingua: {len(subset)} questions, {len(chunks)} chunks, {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)

    rows = []
    for qi, q in enumerate(corpus.questions):
        kept: dict[str, set[int]] = {}
        seconds: dict[str, float] = {}
        t = time.perf_counter()
        result = compress(docs, query=q["query"], ratio=ratio, count_tokens=count)
        seconds["ours"] = time.perf_counter() - t
        kept["ours"] = {index[(s.doc, s.start, s.end)] for s in result.spans}
        trace_ok = all(texts[s.doc][s.start:s.end] in result.text for s in result.spans)
        for m in ("random", "head", "bm25", "embedding"):
            t = time.perf_counter()
            kept[m] = top_k(costs, baseline_order(m, q["query"], unit_texts, unit_emb, rng), budget)
            seconds[m] = time.perf_counter() - t
        if ablate:
            t = time.perf_counter()
            kept["ours_no_context"] = {index[k] for k in without_context(docs, q["query"], ratio, count)}
            seconds["ours_no_context"] = time.perf_counter() - t
        if qi in lingua_kept:
            kept["llmlingua"], seconds["llmlingua"] = lingua_kept[qi]
        gold = index[(q["doc"], *q["gold"])]
        gold_words = set(words(units[gold].text))
        cues = q["cue_words"]
        bm25 = bm25_scores(unit_texts, q["query"])
        window = section_window(units, costs, gold)
        row = {"type": q["type"], "split": q["split"], "doc": q["doc"], "gold": q["gold"], "query": q["query"],
               "window": join_units(units, window),
               "prompt": q["prompt"], "answer": q["answer_text"],
               "cue_overlap": float(np.mean([w in gold_words for w in cues])) if cues else 0.0,
               "bm25_rank": int((bm25 > bm25[gold]).sum()) + 1, "methods": {}}
        for m in kept:
            k = kept[m]
            a, b = q["answer"]
            out_tokens = result.compressed_tokens if m == "ours" else int(costs[sorted(k)].sum())  # (no separators)
            row["methods"][m] = {
                "answer": any(units[i].doc == q["doc"] and units[i].start <= a and b <= units[i].end for i in k),
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


def add_model_metric(scorer: AnswerScorer, res: dict, per_split: int | None = None) -> None:
    """Fills each method's `logprob_loss` (nats per answer token) and each row's `gold_logprob`, on the first
    `per_split` questions of each split (all when None)."""
    items, where = [], []
    chosen = llmlingua_subset(res["rows"], per_split) if per_split is not None else range(len(res["rows"]))
    for q in chosen:
        row = res["rows"][q]
        for m in (None, *row["methods"]):
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
    for q in chosen:
        row = res["rows"][q]
        for x in row["methods"].values():
            x["logprob_loss"] = row["gold_logprob"] - x["logprob"]
    print(f"  model metric: {len(items)} prompts in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)


def bootstrap(values: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean (over questions)."""
    if values.size == 0:
        return (float("nan"), float("nan"))
    idx = np.random.default_rng(seed).integers(0, values.size, size=(reps, values.size))
    means = values[idx].mean(axis=1)
    return (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))


def method_table(rows: list[dict], m: str) -> dict | None:
    rs = [row for row in rows if m in row["methods"]]
    if not rs:
        return None
    ms = [row["methods"][m] for row in rs]
    answer = np.array([x["answer"] for x in ms], dtype=float)
    table = {"questions": len(rs),
             "answer_span_retention": float(answer.mean()), "answer_span_retention_ci95": bootstrap(answer),
             "by_type": {t: float(np.mean([row["methods"][m]["answer"] for row in rs if row["type"] == t]))
                         for t in sorted({row["type"] for row in rs})},
             "gold_sentence_recall": float(np.mean([x["gold"] for x in ms])),
             "anchor_preservation": float(np.mean([x["anchors"] for x in ms])),
             "trace_exact": float(np.mean([x["trace"] for x in ms])),
             "ratio": float(np.mean([x["ratio"] for x in ms])),
             "seconds_per_question": float(np.mean([x["seconds"] for x in ms]))}
    if m != "ours":  # paired over the questions both ran on
        diff = np.array([row["methods"]["ours"]["answer"] - row["methods"][m]["answer"] for row in rs], dtype=float)
        table["ours_minus_this"] = float(diff.mean())
        table["ours_minus_this_ci95"] = bootstrap(diff)
    scored = [x["logprob_loss"] for x in ms if "logprob_loss" in x]
    if scored:
        table["logprob_loss_nats_per_token"] = float(np.mean(scored))
        table["logprob_questions"] = len(scored)
        if m != "ours":
            paired = [row for row in rs if "logprob_loss" in row["methods"][m]]
            table["ours_logprob_loss_same_questions"] = float(np.mean(
                [row["methods"]["ours"]["logprob_loss"] for row in paired]))
    return table


def summary(res: dict) -> dict:
    out = {}
    for split in ("tune", "held-out"):
        rows = [row for row in res["rows"] if row["split"] == split]
        if not rows:
            continue
        ranks = np.array([row["bm25_rank"] for row in rows])
        table: dict = {"overlap": {
            "cue_words_in_gold_sentence": float(np.mean([row["cue_overlap"] for row in rows])),
            "gold_bm25_rank_median": float(np.median(ranks)),
            "gold_bm25_rank1_share": float(np.mean(ranks == 1)),
            "gold_bm25_top10_share": float(np.mean(ranks <= 10)),
            "types": {t: sum(row["type"] == t for row in rows) for t in sorted({row["type"] for row in rows})}}}
        for m in METHODS:
            t = method_table(rows, m)
            if t is not None:
                table[m] = t
        gold = [row["gold_logprob"] for row in rows if "gold_logprob" in row]
        if gold:
            table["gold_logprob_nats_per_token"] = float(np.mean(gold))
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
    ap.add_argument("--license-questions", type=int, default=400,
                    help="licenses: at most this many questions per gold license (the generator makes fewer)")
    ap.add_argument("--parts", default="routing,multi,en,zh",
                    help="comma-separated: routing, multi, en, zh, licenses (the larger license set)")
    ap.add_argument("--positions", default="first,middle,last",
                    help=f"where the gold license goes (multi, licenses): of {','.join(POSITIONS)}")
    ap.add_argument("--qset", choices=("paraphrased", "template"), default="paraphrased")
    ap.add_argument("--split", choices=("tune", "held-out", "both"), default="both")
    ap.add_argument("--no-model", action="store_true", help="skip the model metric")
    ap.add_argument("--model-questions", type=int, default=None,
                    help="the model metric on the first N questions of each split only")
    ap.add_argument("--llmlingua", type=int, default=0, metavar="N",
                    help="LongLLMLingua's ranking on the first N questions of each split (0: off)")
    ap.add_argument("--llmlingua-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="LongLLMLingua's scorer dtype (float32: llmlingua's own on CPU)")
    ap.add_argument("--ablate-context", action="store_true",
                    help="also run ours without the neighbour weight (method ours_no_context)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    count = default_counter()
    rng = np.random.default_rng(0)
    parts = set(args.parts.split(","))
    report: dict = {"ratio": args.ratio, "qset": args.qset, "split": args.split, "corpora": []}
    if "routing" in parts:
        report["routing"] = {split: routing(debian_policy(), maint_guide_zh(), seed)
                             for split, seed in ROUTING_SEEDS.items()}
    all_rows: list[list[dict]] = []
    grouped: dict[str, list[dict]] = {}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
            Path(args.out).with_suffix(".rows.json").write_text(json.dumps(all_rows, ensure_ascii=False))

    save()
    scorer = None if args.no_model else AnswerScorer()
    lingua = LongLLMLingua(args.llmlingua_dtype) if args.llmlingua > 0 else None
    for c in corpora(parts, args.questions, args.zh_questions, args.multi_questions, args.qset, args.split,
                     tuple(args.positions.split(",")), args.license_questions):
        # the report is rewritten after each corpus
        res = run_corpus(c, args.ratio, count, rng, lingua, args.llmlingua, args.ablate_context)
        if scorer is not None:
            add_model_metric(scorer, res, args.model_questions)
        report["corpora"].append({k: v for k, v in res.items() if k != "rows"}
                                 | {"group": c.group, "questions": len(res["rows"]), "splits": summary(res)})
        all_rows.append(res["rows"])
        if c.group:
            grouped.setdefault(c.group, []).extend(res["rows"])
            report["groups"] = {g: {"corpora": sum(x["group"] == g for x in report["corpora"]),
                                    "questions": len(rows), "splits": summary({"rows": rows})}
                                for g, rows in grouped.items()}
        save()
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
