"""Contract compliance review on compressed context (issue 17, the seeds' section 4.1): each rule compresses
the contract for its own question and cites every finding by document, section, paragraph, page and character
offsets through the trace map.

    .venv/bin/python examples/contract_review.py CONTRACT.txt [--rate-cap 24] [--ratio 3.4] [--json]
    .venv/bin/python examples/contract_review.py CONTRACT.txt --server http://127.0.0.1:8000/v1 \
        [--target-tokens 1500] [--sparse block --sparse-top-k 256] [--json]

Rules: an interest or penalty rate above the cap is a violation; a guarantee, a limitation of liability, a
termination notice period and a governing-law clause must each be found ("missing" otherwise).

Rule-based path (default, model-free): compresses locally per rule and scans the kept spans with the rule's
pattern. Model path (`--server`): per rule, one chat request through the official `openai` client to a running
`glmserve serve`, carrying the whole contract as `context_compression` (the rule's query; the server compresses
before prefill to `--target-tokens`) and `sparse_attention` (block-sparse decode, top-k `--sparse-top-k`;
`--sparse server` sends none and leaves the server's default). The model is asked, with a one-shot example,
for the sentence that answers the rule, or NONE. By default the answer is constrained (`guided_choice`) to the
sentences the server keeps for that query (read first from POST /v1/compress, which runs the same deterministic
compression), so a 135M model's answer is always parseable and a verbatim source sentence; `--free` lets it
write one free line instead. The answer is located in the trace map's kept spans (glmserve/compress/locate.py
`locate_quote`: the exact substring, else the kept span that shares most of its characters), and the verdict
applies the rule's pattern to the cited source text (a rate is compared with the cap): a quote that is not in a
kept span, or that does not state what the rule asks, gives "missing".

A server for long contracts, with block-sparse decode and a KV pool of 1,024 tokens (SmolLM2 in float32: 46,080
bytes a token) smaller than the compressed prompt, so that chunked prefill (256 tokens a step) offloads old KV
chunks (256 tokens) to disk and decode reads back only the blocks holding a selected token (README: "Contexts
longer than the pool"); the uncompressed contract (30K-120K tokens) is far beyond both the pool and SmolLM2's
8K context:

    glmserve serve --sparse-attention block --sparse-top-k 256 --sparse-local-tokens 128 \
        --kv-cache-memory-bytes 47185920 --kv-chunk-tokens 256 --max-num-batched-tokens 256 \
        --kv-disk-dir /tmp/glmserve-kv

Measured accuracy of both paths on synthetic contracts: bench/bench_contract_review.py, bench/RESULTS.md
"Contract review on the model".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.compress import Document, Span, compress  # noqa: E402
from glmserve.compress.locate import locate_quote  # noqa: E402

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s?(?:%|percent)\s*(?:per\s+(annum|year|month)|a\s+(year|month))?", re.I)


@dataclass(frozen=True)
class Rule:
    name: str
    query: str  # what the compressor keeps context for
    pattern: re.Pattern[str]  # what the cited text must state
    ask: str  # "Which sentence states ...?" for the model


RULES = [
    Rule("rate_cap", "interest rate, late payment penalty or fee percentage", _RATE,
         "the interest rate or the late payment charge on overdue amounts"),
    Rule("guarantee", "guarantee, guarantor or security for the obligations",
         re.compile(r"\bguarant(?:ee|or|ees|y)\b|担保|保证", re.I),
         "that a guarantor guarantees the obligations of the Supplier"),
    Rule("liability", "limitation of liability, damages cap, indemnity",
         re.compile(r"\bliabilit(?:y|ies)\b|\bindemnif|责任", re.I), "the limit of the Supplier's total liability"),
    Rule("termination", "termination and notice period",
         re.compile(r"\bterminat\w*\b[^.]*\b\d+\s+(?:business\s+)?days\b|解除|终止", re.I),
         "the notice period for terminating this Agreement"),
    Rule("governing_law", "governing law and jurisdiction",
         re.compile(r"\bgoverned by\b|\bgoverning law\b|适用法律", re.I), "the law that governs this Agreement"),
]

COMPRESS_TIMEOUT_S = 600  # POST /v1/compress of a 120K-token contract on a loaded 2-core machine
MODEL_TARGET_TOKENS = 1500  # what a 135M model with an 8K context reads in reasonable time on a CPU
SYSTEM = ("You check contracts. Answer with one sentence copied word for word from the documents, or NONE if "
          "no sentence says it.\n\nExample.\nDocuments:\n4.2 Payment\nInvoices are sent monthly. The Customer "
          "shall pay each invoice within 30 days of receipt. Payments are made in euros.\n"
          "Question: Which sentence states the payment deadline?\n"
          "Answer: The Customer shall pay each invoice within 30 days of receipt.")


@dataclass(frozen=True)
class Finding:
    rule: str
    status: str  # "ok", "violation" or "missing"
    doc: str = ""
    section: str = ""
    paragraph: int = 0
    page: int = 0
    quote: str = ""  # the cited source text: exactly documents[doc][start:end]
    note: str = ""
    start: int = -1
    end: int = -1
    match: str = ""  # model path: "exact" (the answer is the cited text) or "span" (the kept span it overlaps)
    answer: str = ""  # model path: the model's raw answer


def annual_rate(match: re.Match[str]) -> float:
    value = float(match.group(1))
    return value * 12 if (match.group(2) or match.group(3) or "").lower() == "month" else value


def check(rule: Rule, text: str, rate_cap: float) -> tuple[str, str] | None:
    """The rule's verdict on a cited text, (status, note), or None when the text does not state what it asks."""
    m = rule.pattern.search(text)
    if m is None:
        return None
    if rule.name != "rate_cap":
        return "ok", ""
    rate = annual_rate(m)
    return ("violation" if rate > rate_cap else "ok"), f"{rate:g}% a year against a cap of {rate_cap:g}%"


def review(documents: list[Document], rate_cap: float, ratio: float | None,
           target_tokens: int | None = None) -> list[Finding]:
    """The rule-based path: every kept span the rule's pattern matches is a finding (compressed to `ratio`, or to
    `target_tokens` when given)."""
    texts = {d.id: d.text for d in documents}
    findings = []
    for rule in RULES:
        result = compress(documents, query=rule.query, ratio=None if target_tokens else ratio,
                          target_tokens=target_tokens)
        hits = []
        for span in result.spans:
            quote = texts[span.doc][span.start:span.end]
            verdict = check(rule, quote, rate_cap)
            if verdict:
                hits.append(Finding(rule.name, verdict[0], span.doc, span.section, span.paragraph, span.page, quote,
                                    verdict[1], span.start, span.end))
        findings.extend(hits or [Finding(rule.name, "missing", note=f"no kept span matches: {rule.query}")])
    return findings


def _answer_text(content: str | None) -> str:
    """The quoted sentence of a model answer: its first line, less an "Answer:" prefix and wrapping quotes."""
    line = (content or "").strip().split("\n", 1)[0].strip()
    line = re.sub(r"^(?:answer|quote)\s*:\s*", "", line, flags=re.I)
    return line.strip("\"'“”‘’ \t")


def trace_spans(reply: Any) -> list[Span]:
    """The kept spans of the trace map a chat answer carries (`context_compression`, glmserve's extra)."""
    trace = (reply.model_extra or {}).get("context_compression")
    if not trace:
        raise RuntimeError("the server answered without a context_compression trace map (is it glmserve serve?)")
    return [Span(**{**s, "anchors": tuple(s.get("anchors", ()))}) for s in trace["spans"]]


def kept_sentences(client: Any, documents: list[Document], rule: Rule, target_tokens: int) -> list[str]:
    """The sentences the server keeps for the rule (POST /v1/compress, the same deterministic compression the
    chat request's context_compression runs), less headings: the choices of a constrained answer."""
    body = {"documents": [{"id": d.id, "text": d.text} for d in documents], "query": rule.query,
            "target_tokens": target_tokens}
    reply = httpx.post(f"{str(client.base_url).rstrip('/')}/compress", json=body, timeout=COMPRESS_TIMEOUT_S)
    reply.raise_for_status()
    texts = {d.id: d.text for d in documents}
    kept = [texts[s["doc"]][s["start"]:s["end"]] for s in reply.json()["spans"] if "heading" not in s["anchors"]]
    return list(dict.fromkeys(k for k in kept if "\n" not in k))


def ask_model(client: Any, model: str, documents: list[Document], rule: Rule, target_tokens: int,
              sparse: dict[str, Any] | None, max_tokens: int, choices: list[str] | None = None) -> Any:
    """One chat request for one rule: the contract compressed by the server for the rule's query; with
    `choices`, the answer is constrained to one of them (`guided_choice`)."""
    extra: dict[str, Any] = {"context_compression": {
        "documents": [{"id": d.id, "text": d.text} for d in documents], "query": rule.query,
        "target_tokens": target_tokens}}
    if sparse is not None:
        extra["sparse_attention"] = sparse
    if choices:
        extra["guided_choice"] = [*choices, "NONE"]
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens, stop=None if choices else ["\n"], extra_body=extra,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": f"Question: Which sentence states {rule.ask}?\nAnswer:"}])


def review_with_model(client: Any, model: str, documents: list[Document], rate_cap: float, target_tokens: int,
                      sparse: dict[str, Any] | None, max_tokens: int = 80, constrained: bool = True) -> list[Finding]:
    """The model path: per rule, the model's quote located in the kept spans, then the rule's check on it.
    `constrained`: the answer is one of the kept sentences or NONE (guided choice), else free text (one line)."""
    texts = {d.id: d.text for d in documents}
    findings = []
    for rule in RULES:
        choices = kept_sentences(client, documents, rule, target_tokens) if constrained else None
        if choices == []:  # the budget went to headings (never dropped): no sentence to choose from
            findings.append(Finding(rule.name, "missing", note="no sentence kept within the budget"))
            continue
        # a constrained answer must be able to finish its longest choice (a token holds >= 2 characters)
        limit = max(max_tokens, 8 + max(map(len, choices)) // 2) if choices else max_tokens
        reply = ask_model(client, model, documents, rule, target_tokens, sparse, limit, choices)
        answer = _answer_text(reply.choices[0].message.content)
        spans = trace_spans(reply)
        found = None
        if answer and answer.upper() != "NONE":
            for doc in documents:
                hit = locate_quote(doc.text, [s for s in spans if s.doc == doc.id], answer)
                if hit is not None:
                    found = (doc.id, hit)
                    break
        if found is None:
            why = "the model found no sentence" if not answer or answer.upper() == "NONE" else \
                "the model's answer is not in a kept span"
            findings.append(Finding(rule.name, "missing", note=why, answer=answer))
            continue
        doc_id, hit = found
        cited = texts[doc_id][hit.start:hit.end]
        verdict = check(rule, cited, rate_cap)
        status, note = verdict or ("missing", f"the quoted text does not state {rule.ask}")
        findings.append(Finding(rule.name, status, doc_id, hit.section, hit.paragraph, hit.page, cited, note,
                                hit.start, hit.end, "exact" if hit.exact else "span", answer))
    return findings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rate-cap", type=float, default=24.0, help="highest lawful annual rate, percent")
    ap.add_argument("--ratio", type=float, default=3.4, help="rule-based path: compression ratio")
    ap.add_argument("--server", metavar="URL", help="model path: a glmserve serve base URL, e.g. "
                                                    "http://127.0.0.1:8000/v1")
    ap.add_argument("--model", help="model path: the model id (default: the server's first)")
    ap.add_argument("--target-tokens", type=int, help="compressed contract size in tokens (default: --ratio for the "
                                                      f"rule-based path, {MODEL_TARGET_TOKENS} for the model path)")
    ap.add_argument("--sparse", default="block", choices=["dense", "block", "learned", "native", "server"],
                    help="model path: sparse decode mode sent per request ('server': the server's default)")
    ap.add_argument("--sparse-top-k", type=int, default=256, help="model path: sparse decode token budget")
    ap.add_argument("--free", action="store_true", help="model path: a free-text answer instead of one constrained "
                                                        "to the kept sentences (guided_choice)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    docs = [Document(f, Path(f).read_text(encoding="utf-8")) for f in args.files]
    if args.server:
        from openai import OpenAI

        client = OpenAI(base_url=args.server, api_key="unused")
        model = args.model or client.models.list().data[0].id
        sparse = None if args.sparse == "server" else \
            {"mode": "dense"} if args.sparse == "dense" else {"mode": args.sparse, "top_k": args.sparse_top_k}
        findings = review_with_model(client, model, docs, args.rate_cap, args.target_tokens or MODEL_TARGET_TOKENS,
                                     sparse, constrained=not args.free)
    else:
        findings = review(docs, args.rate_cap, args.ratio, args.target_tokens)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], ensure_ascii=False, indent=1))
        return
    for f in findings:
        where = f"{f.doc} §{f.section} ¶{f.paragraph} p.{f.page} [{f.start}:{f.end}]" if f.doc else "-"
        print(f"[{f.status:9}] {f.rule:13} {where}: {f.note or f.quote[:100]}")


if __name__ == "__main__":
    main()
