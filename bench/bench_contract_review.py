"""Contract compliance review on seeded synthetic contracts (glmserve/compress/synthetic_contract.py): finding
accuracy and citation exactness of the rule-based path and of the model path (examples/contract_review.py),
wall time, and the server's KV pool, peak KV use, offloaded KV and peak RSS.

Paths, per contract and rule:
  rules@ratio   model-free: the contract compressed locally to --ratio, kept spans scanned with the rule's pattern;
  rules@budget  the same at the model path's token budget (--target-tokens);
  model         one chat request to a `glmserve serve` (embedded SmolLM2-135M-Instruct) with context_compression
                (to --target-tokens) and block-sparse decode, on a KV pool smaller than the compressed prompt
                (chunked prefill and KV offload to a disk dir); the model's quote located in the trace map.
A rule's verdict is "violation" if a finding is, else "ok" if one is, else "missing"; it is correct when it
equals the gold verdict. A citation is exact when a finding of that rule overlaps a gold fact's offsets and
cites its section and paragraph; citation exactness is over the rules whose gold has a clause.

    python bench/bench_contract_review.py --lengths 30000,120000 --seeds 0 --out bench/results/contract-review.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from example_modules import load_example  # noqa: E402
from harness import hwm_kb  # noqa: E402
from serve_process import glmserve  # noqa: E402

from glmserve.compress import Document  # noqa: E402
from glmserve.compress.synthetic_contract import RULE_NAMES, SyntheticContract, generate  # noqa: E402
from glmserve.compress.tokens import default_counter  # noqa: E402

review = load_example("contract_review")
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, float32 KV: 2 x 30 layers x 3 kv heads x 64 x 4 bytes


def verdict(findings: list, rule: str) -> str:
    statuses = {f.status for f in findings if f.rule == rule}
    return next((s for s in ("violation", "ok") if s in statuses), "missing")


def score(contract: SyntheticContract, findings: list) -> list[dict]:
    rows = []
    for rule in RULE_NAMES:
        gold = contract.gold(rule)
        cited = [f for f in findings if f.rule == rule and f.doc]
        exact = [f for f in cited for g in gold.facts
                 if f.start < g.end and f.end > g.start and (f.section, f.paragraph) == (g.section, g.paragraph)]
        rows.append({"rule": rule, "gold": gold.status, "verdict": verdict(findings, rule),
                     "correct": verdict(findings, rule) == gold.status, "has_clause": bool(gold.facts),
                     "cited_exact": bool(exact), "citations": len(cited),
                     "answer": next((f.answer for f in findings if f.rule == rule), "")})
    return rows


def summary(rows: list[dict]) -> dict:
    clauses = [r for r in rows if r["has_clause"]]
    return {"rules": len(rows), "accuracy": round(sum(r["correct"] for r in rows) / len(rows), 3),
            "citation_exact": round(sum(r["cited_exact"] for r in clauses) / max(1, len(clauses)), 3),
            "clauses": len(clauses)}


class MetricsSampler:
    """Polls the server's /metrics: peak KV-cache usage and peak bytes of offloaded KV, last counter values."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.peak = {"kv_cache_usage": 0.0, "kv_stream_bytes": 0.0}
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        for m in re.finditer(r"^glmserve_(\w+) ([0-9.e+-]+)$", text, re.M):
            self.last[m.group(1)] = float(m.group(2))
        for k in self.peak:
            self.peak[k] = max(self.peak[k], self.last.get(k, 0.0))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="30000,120000", help="contract sizes in tokens")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--ratio", type=float, default=3.4)
    ap.add_argument("--target-tokens", type=int, default=review.MODEL_TARGET_TOKENS)
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument("--sparse-top-k", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--paths", default="model,rules", help="model and/or rules (rules@ratio and rules@budget)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    counter = default_counter()
    contracts = [generate(int(s), int(n)) for n in args.lengths.split(",") for s in args.seeds.split(",")]
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "contracts": [], "rows": []}
    for c in contracts:
        result["contracts"].append({"seed": c.seed, "tokens": int(counter([c.text])[0]), "chars": len(c.text),
                                    "omitted": list(c.omitted), "rate_gold": c.gold("rate_cap").status})

    def run_path(path: str, c: SyntheticContract, fn) -> None:
        t = time.perf_counter()
        findings = fn([Document("contract", c.text)], c.rate_cap)
        wall = time.perf_counter() - t
        rows = score(c, findings)
        info = next(x for x in result["contracts"] if x["seed"] == c.seed and x["chars"] == len(c.text))
        result["rows"].append({"path": path, "tokens": info["tokens"], "seed": c.seed, "wall_s": round(wall, 1),
                               **summary(rows), "per_rule": rows})
        print(json.dumps(result["rows"][-1]), flush=True)

    if "model" in args.paths.split(","):
        result["server"] = run_model(args, contracts, run_path)
        print(json.dumps(result["server"]), flush=True)
    if "rules" in args.paths.split(","):
        for c in contracts:
            run_path("rules@ratio", c, lambda docs, cap: review.review(docs, cap, args.ratio))
            run_path("rules@budget", c, lambda docs, cap: review.review(docs, cap, None, args.target_tokens))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def run_model(args: argparse.Namespace, contracts: list[SyntheticContract], run_path) -> dict:
    """The model path on every contract against one server; the server's KV pool, peaks and counters."""
    with tempfile.TemporaryDirectory() as kv_dir:
        flags = ["--sparse-attention", "block", "--sparse-top-k", str(args.sparse_top_k), "--sparse-local-tokens",
                 "128", "--kv-cache-memory-bytes", str(args.pool_tokens * KV_BYTES_PER_TOKEN), "--kv-chunk-tokens",
                 "256", "--max-num-batched-tokens", "256", "--kv-disk-dir", kv_dir]
        log = Path(kv_dir) / "serve.log"
        with glmserve(flags, log, ready_timeout_s=600) as base_url:
            pid = int(re.search(r"Started server process \[(\d+)\]", log.read_text()).group(1))
            client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=3600)
            model = client.models.list().data[0].id
            sparse = {"mode": "block", "top_k": args.sparse_top_k}
            with MetricsSampler(base_url) as metrics:
                for c in contracts:
                    run_path("model", c, lambda docs, cap: review.review_with_model(
                        client, model, docs, cap, args.target_tokens, sparse, args.max_tokens))
            pool = re.search(r"KV pool (\d+) blocks x (\d+) tokens \(\w+\), ([0-9.]+) MB", log.read_text())
            return {
                "flags": flags[:-1] + ["<tmp>"], "pool_tokens": int(pool.group(1)) * int(pool.group(2)),
                "pool_mb": float(pool.group(3)), "peak_kv_cache_usage": round(metrics.peak["kv_cache_usage"], 3),
                "peak_offloaded_kv_mb": round(metrics.peak["kv_stream_bytes"] / 2**20, 1),
                "peak_rss_mb": round(hwm_kb(pid) / 1024, 1),
                **{k: metrics.last.get(k, 0.0) for k in (
                    "prompt_tokens_total", "generation_tokens_total", "kv_stream_offloaded_chunks_total",
                    "kv_stream_read_slices_total", "kv_stream_skipped_slices_total")}}


if __name__ == "__main__":
    main()
